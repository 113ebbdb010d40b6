"""Where one decode step's time goes: the torch profiler over stepahead's decode steps
(`benchmarks/forward.py`'s runner setup: ~256 KV tokens per request), ops grouped by class.

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/profile_decode.py --model smollm2-135m --batch 64 \
        [--threads 1] [--steps 8] [--rounds 2] [--out benchmarks/results/profile_decode_smollm2-135m.json]

The setups, profiled in turn for `--rounds` rounds (each setup's round with the least profiled
time is reported, the others being the shared machine's noise): `reference` (`--attention-backend
torch`: gather the blocks, then SDPA), `default` (the CPU paged-decode kernel and layer
kernels), `unpacked` (`--no-cpu-prepack-weights`), `torch_layer_ops` (torch's own ops for the
norms, rotary and SiLU·mul) and `compiled` (`--no-enforce-eager` beside the kernel).

Classes (the self time of each aten op, on the calling thread): matmul (mm/addmm/bmm), attention
(the paged KV write and gather, SDPA and its masks), norms/rope/activations (pointwise), sampling
(everything under the runner's `_sample`), other ops; `python` is the step's wall time not spent in
any op (interpreter, module calls, input building).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.forward import model_dir, runner_step
from worker_service import cpu_kernels
from worker_service.cpu_kernels import attach_layer_ops
from worker_service.paged_attention import CpuDecodeBackend

MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_mkl_linear",
          "aten::_linear_pointwise", "mkldnn::_linear_pointwise", "mkl::_mkl_linear"}
ATTENTION = {"aten::index_copy_", "aten::index_select", "aten::scaled_dot_product_attention",
             "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
             "aten::arange", "aten::lt", "aten::ge", "aten::__and__", "aten::bitwise_and", "aten::softmax",
             "aten::_softmax", "aten::masked_fill", "stepahead::write_kv", "stepahead::paged_decode"}
POINTWISE = {"aten::rms_norm", "aten::_fused_rms_norm", "aten::roll", "aten::addcmul", "aten::mul", "aten::silu",
             "aten::add", "aten::add_", "aten::copy_", "aten::cat", "aten::embedding", "aten::pow", "aten::mean",
             "aten::rsqrt", "aten::neg", "aten::clone", "aten::_to_copy", "aten::to"}

LAYER_KERNELS = {"stepahead::add_rms_norm", "stepahead::rms_norm", "stepahead::silu_and_mul", "stepahead::rotary_"}


def classify(name: str) -> str:
    if name in MATMUL:
        return "matmul"
    if name in ATTENTION or name == "stepahead::paged_decode_cpu":
        return "attention"
    if name in POINTWISE or name in LAYER_KERNELS:
        return "norm_rope_act"
    if name.startswith("Torch-Compiled Region") or name.startswith("CompiledFunction") or "graph_" in name:
        return "compiled_region"
    return "other_ops"


def profile_steps(step, runner, steps: int) -> dict:
    """Profile `steps` calls of `step`; per-class self times (ms per step), top ops, wall time."""
    sample = runner._sample

    def traced_sample(*a, **k):
        with record_function("stepahead::sample"):
            return sample(*a, **k)

    runner._sample = traced_sample
    for _ in range(2):
        step()
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            with record_function("stepahead::step"):
                step()
            walls.append(time.perf_counter() - t0)
    runner._sample = sample
    events = prof.events()
    sample_ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name == "stepahead::sample"]
    step_total = sum(e.cpu_time_total for e in events if e.name == "stepahead::step")
    by_class: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    for e in events:
        if e.name in ("stepahead::step", "stepahead::sample"):
            continue
        inside = any(s <= e.time_range.start and e.time_range.end <= t for s, t in sample_ranges)
        cls = "sampling" if inside else classify(e.name)
        by_class[cls] += e.self_cpu_time_total
        if not inside:
            by_op[e.name] += e.self_cpu_time_total
    classes = {k: v / steps / 1e3 for k, v in by_class.items()}
    classes["python"] = step_total / steps / 1e3 - sum(classes.values())
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:12]
    return {"profiled_ms": step_total / steps / 1e3, "wall_ms": statistics.median(walls) * 1e3,
            "classes_ms": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
            "top_ops_ms": {k: v / steps / 1e3 for k, v in top}}


SETUPS = {"reference": dict(attention="torch"), "default": {}, "unpacked": dict(pack=False),
          "torch_layer_ops": dict(layer_ops=False), "compiled": dict(compile=True)}


class NamedLayerOps:
    """The CPU layer kernels with each call a profiler range (`stepahead::<kernel>`), so the profile
    counts them as ops (a pybind call is no aten op)."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        fn = getattr(self._module, name)

        def named(*args):
            with record_function(f"stepahead::{name}"):
                return fn(*args)

        return named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = model_dir(args.model)
    runners = {name: runner_step(path, args.batch, (args.steps + 2) * args.rounds + 2, with_runner=True,
                                 **SETUPS[name]) for name in args.setups}
    for step, runner in runners.values():
        if runner.cpu_layer_ops and any(getattr(m, "cpu_ops", None) is not None for m in runner.model.modules()):
            attach_layer_ops(runner.model, NamedLayerOps(cpu_kernels.load()))
        if isinstance(runner.backend, CpuDecodeBackend):  # its K/V write is a pybind call too
            runner.backend._kernel = NamedLayerOps(runner.backend._kernel)
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name, (step, runner) in runners.items():
            result = profile_steps(step, runner, args.steps)
            if name not in best or result["profiled_ms"] < best[name]["profiled_ms"]:
                best[name] = result
    for name, r in best.items():
        print(f"{args.model} batch {args.batch}, {args.threads} thread(s), {name}: step {r['profiled_ms']:.2f} ms "
              f"profiled (wall median {r['wall_ms']:.2f} ms)")
        for k, v in r["classes_ms"].items():
            print(f"  {k:>16} {v:8.2f} ms  {100 * v / r['profiled_ms']:5.1f}%")
        print("  top ops (self ms per step): " + ", ".join(f"{k} {v:.2f}" for k, v in r["top_ops_ms"].items()))
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__,
                                        "setups": best}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
