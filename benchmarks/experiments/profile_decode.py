"""Where one decode step's time goes: the torch profiler over stepahead's decode steps
(`benchmarks/forward.py`'s runner setup: ~256 KV tokens per request), ops grouped by class.

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/profile_decode.py --model smollm2-135m --batch 64 \
        [--threads 1] [--steps 10] [--enforce-eager | --compile] [--out benchmarks/results/profile_decode.json]

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

MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_mkl_linear",
          "aten::_linear_pointwise", "mkldnn::_linear_pointwise", "mkl::_mkl_linear"}
ATTENTION = {"aten::index_copy_", "aten::index_select", "aten::scaled_dot_product_attention",
             "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
             "aten::arange", "aten::lt", "aten::ge", "aten::__and__", "aten::bitwise_and", "aten::softmax",
             "aten::_softmax", "aten::masked_fill"}
POINTWISE = {"aten::rms_norm", "aten::_fused_rms_norm", "aten::roll", "aten::addcmul", "aten::mul", "aten::silu",
             "aten::add", "aten::add_", "aten::copy_", "aten::cat", "aten::embedding", "aten::pow", "aten::mean",
             "aten::rsqrt", "aten::neg", "aten::clone", "aten::_to_copy", "aten::to"}


def classify(name: str) -> str:
    if name in MATMUL:
        return "matmul"
    if name in ATTENTION:
        return "attention"
    if name in POINTWISE:
        return "norm_rope_act"
    if name.startswith("Torch-Compiled Region") or name.startswith("CompiledFunction") or "graph_" in name:
        return "compiled_region"
    return "other_ops"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="the compiled step (default: eager)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    step, runner = runner_step(model_dir(args.model), args.batch, args.steps + 5, compile=args.compile,
                               with_runner=True)
    sample = runner._sample

    def traced_sample(*a, **k):
        with record_function("stepahead::sample"):
            return sample(*a, **k)

    runner._sample = traced_sample
    for _ in range(3):
        step()
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            with record_function("stepahead::step"):
                step()
            walls.append(time.perf_counter() - t0)
    events = [e for e in prof.events() if e.thread == prof.events()[0].thread or True]
    by_class: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    sampling = 0.0
    step_total = 0.0
    for e in prof.key_averages():
        if e.key == "stepahead::sample":
            sampling = e.cpu_time_total
        elif e.key == "stepahead::step":
            step_total = e.cpu_time_total
    # self time of each op, attributing the ops under the sample region to sampling
    sample_ranges = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.name == "stepahead::sample"]
    for e in prof.events():
        if e.name.startswith("stepahead::"):
            continue
        inside = any(s <= e.time_range.start and e.time_range.end <= t for s, t in sample_ranges)
        cls = "sampling" if inside else classify(e.name)
        by_class[cls] += e.self_cpu_time_total
        if not inside:
            by_op[e.name] += e.self_cpu_time_total
    n = args.steps
    wall_ms = statistics.median(walls) * 1e3
    ops_ms = {k: v / n / 1e3 for k, v in by_class.items()}
    ops_ms["python"] = step_total / n / 1e3 - sum(ops_ms.values())
    print(f"{args.model} batch {args.batch}, {args.threads} thread(s), {'compiled' if args.compile else 'eager'}: "
          f"step wall median {wall_ms:.2f} ms (profiled, {step_total / n / 1e3:.2f} ms)")
    for k, v in sorted(ops_ms.items(), key=lambda kv: -kv[1]):
        print(f"  {k:>16} {v:8.2f} ms  {100 * v / (step_total / n / 1e3):5.1f}%")
    print("  top ops (self ms per step):")
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:18]
    for k, v in top:
        print(f"    {k:>50} {v / n / 1e3:8.3f}")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__,
                                        "step_wall_ms": wall_ms, "classes_ms": ops_ms,
                                        "top_ops_ms": {k: v / n / 1e3 for k, v in top}}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
