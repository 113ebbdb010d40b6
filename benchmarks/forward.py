"""Per-decode-step time: stepahead's ModelRunner vs Hugging Face (with its KV cache) vs the
bare-matmul floor, for the built-in `tiny`, `100m` and `smollm2-135m` models, ~256 tokens of KV
per request, batch 1/8/32/64. Prints a table and writes JSON.

    python benchmarks/forward.py [--models tiny 100m smollm2-135m] [--batches 1 8 32 64] [--steps 20]
                                 [--repeat 1] [--out benchmarks/forward.json] [--threads N] [--clock wall|cpu]
                                 [--reference] [--compiled] [--unpacked]

Contenders: `stepahead` (the runner as served by default), `hf`, `floor`, `floor_packed`; with
`--unpacked` also `stepahead_unpacked` (`--no-cpu-prepack-weights`), with `--reference`
also `stepahead_ref` (`--attention-backend torch`: gather the blocks, then SDPA), with
`--compiled` also `stepahead_compiled` (`--no-enforce-eager`, compiled and warmed up before
the timed rounds).

Each round runs the three contenders in turn (warm-up, then the timed steps); with
`--repeat R` the ratios are medians of R rounds' ratios, so a load change on a shared
machine between rounds does not skew them.

The runner's requests start as prefix hits (`num_computed_tokens = 256`): the KV content
does not change the decode cost, and this skips a prefill that would dominate the run.
The floor is the model's matrix multiplies alone (fused qkv, o, fused gate/up, down per
layer, then lm_head) on a `[batch, hidden]` input: `floor` through `torch.mm` on the row-major
weights, with preallocated outputs, `floor_packed` through oneDNN on the packed weights the
runner holds by default (the faster of the two is the machine's floor), and `floor_kv` the
packed matmuls plus one plain read of the K/V bytes the step's attention must read (float32
K/V of ~256 tokens per request is as many bytes as the weights at batch 64 on SmolLM2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

KV_TOKENS = 256
SPECS = {  # fallback configs, equal to model_zoo.builtin_models' specs
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                 vocab_size=4096, intermediate_size=512, tie_word_embeddings=False),
    "100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 vocab_size=32000, intermediate_size=2048, tie_word_embeddings=True),
}


def model_dir(name: str) -> Path:
    try:
        from model_zoo.builtin_models import ensure_model
    except ImportError:
        return _fallback_model(name)
    return ensure_model(name)


def _fallback_model(name: str) -> Path:
    import tempfile

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(tempfile.gettempdir()) / f"stepahead-bench-{name}"
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SPECS[name], max_position_embeddings=2048)).save_pretrained(path)
    return path


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def _time_round(step_fns: dict, warmup: int, steps: int) -> dict[str, float]:
    """Median seconds per call of each `step()`: the contenders take turns, each `warmup`
    untimed calls (caches refilled with its own weights) then `steps` timed ones."""
    result = {}
    for name, step in step_fns.items():
        for _ in range(warmup):
            step()
        times = []
        for _ in range(steps):
            t0 = _clock()
            step()
            times.append(_clock() - t0)
        result[name] = statistics.median(times)
    return result


def runner_step(path: Path, batch: int, steps: int, *, compile: bool = False, with_runner: bool = False,
                attention: str = "auto", pack: bool = True, layer_ops: bool = True):
    """A decode step of `batch` requests (`compile`: the runner's compiled forward, warmed up here;
    `attention`: an `--attention-backend` name; `pack`: `--cpu-prepack-weights`; `layer_ops`: False
    takes the CPU layer kernels back, torch's own ops for the norms, rotary and SiLU·mul)."""
    import torch

    from stepahead.plan import NewRequest, RunningRequest, SamplingParams, StepPlan
    from worker_service.attention_names import AttentionBackendName
    from worker_service.model_runner import ModelRunner
    from worker_service.paged_attention import make_backend

    block_size = 16
    total = KV_TOKENS + 1 + steps + 1
    per_req = -(-total // block_size)
    backend = make_backend(AttentionBackendName(attention), torch.device("cpu"), torch.float32, block_size)
    runner = ModelRunner(path, block_size=block_size, num_blocks=batch * per_req, max_model_len=total + 1,
                         enforce_eager=not compile, attention_backend=backend, pack_weights=pack)
    greedy = SamplingParams(temperature=0.0)
    prompt = tuple(range(1, KV_TOKENS + 2))  # KV_TOKENS cached + 1 to decode
    new = tuple(NewRequest(f"r{i}", prompt, greedy, tuple(range(i * per_req, (i + 1) * per_req)), KV_TOKENS, 1)
                for i in range(batch))
    if not layer_ops:
        from worker_service.cpu_kernels import attach_layer_ops

        attach_layer_ops(runner.model, None)
    runner.execute(StepPlan(0, new_requests=new))
    decode = tuple(RunningRequest(f"r{i}", (), 1, input_is_placeholder=True) for i in range(batch))
    step_id = iter(range(1, 1 << 30))

    def step():
        return runner.execute(StepPlan(next(step_id), running=decode))

    return (step, runner) if with_runner else step


def hf_step(path: Path, batch: int):
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        kv = torch.randn(batch, cfg.num_key_value_heads, KV_TOKENS, head_dim)
        cache.update(kv, kv.clone(), layer)
    state = {"pos": KV_TOKENS, "ids": torch.ones(batch, 1, dtype=torch.long)}

    @torch.inference_mode()
    def step():
        pos = torch.full((batch, 1), state["pos"], dtype=torch.long)
        out = model(input_ids=state["ids"], past_key_values=cache, position_ids=pos, use_cache=True)
        state["ids"] = out.logits[:, -1].argmax(-1, keepdim=True)
        state["pos"] += 1

    return step


def floor_step(path: Path, batch: int, packed: bool = False, kv: bool = False):
    """The model's matmuls alone: `torch.mm` on the row-major weights, or (`packed`) oneDNN's
    matmul on the weights packed as the runner holds them (`layers/packed_linear.py`); `kv`: the
    packed matmuls plus one read of the K/V the step's attention must read (every layer's, for
    `batch` requests of KV_TOKENS tokens, summed layer by layer as the step reads them)."""
    import torch

    from worker_service.loader import load_model

    model, cfg = load_model(path, torch.float32, torch.device("cpu"))
    if kv:
        matmuls = floor_step(path, batch, packed=True)
        caches = [torch.randn(2 * batch * KV_TOKENS * cfg.num_kv_heads * cfg.head_dim)
                  for _ in range(cfg.num_layers)]

        @torch.inference_mode()
        def kv_step():
            matmuls()
            for cache in caches:
                cache.sum()

        return kv_step
    linears = []
    for layer in model.model.layers:
        linears += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    linears.append(model.lm_head)
    weights = [m.weight for m in linears]
    x = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}
    if packed:
        from worker_service.layers.packed_linear import PackedLinear

        packs = [(PackedLinear(m), x[m.in_features]) for m in linears]

        @torch.inference_mode()
        def packed_step():
            for p, i in packs:
                p(i)

        return packed_step
    outs = [torch.empty(batch, w.shape[0]) for w in weights]

    @torch.inference_mode()
    def step():
        for w, o in zip(weights, outs):
            torch.mm(x[w.shape[1]], w.t(), out=o)

    return step


STEPAHEAD = ("stepahead", "stepahead_unpacked", "stepahead_ref", "stepahead_compiled")


def run_all(models, batches, warmup, steps, repeat: int = 1, reference: bool = False,
            compiled: bool = False, unpacked: bool = False, done=lambda rows: None) -> list[dict]:
    """One row per (model, batch): per-step medians, and ratios as medians over `repeat` rounds
    (`done(rows)` after each row: a cut run keeps what it measured)."""
    rows = []
    n = (warmup + steps) * repeat
    for name in models:
        path = model_dir(name)
        for batch in batches:
            fns = {"stepahead": runner_step(path, batch, n)}
            if unpacked:
                fns["stepahead_unpacked"] = runner_step(path, batch, n, pack=False)
            if reference:
                fns["stepahead_ref"] = runner_step(path, batch, n, attention="torch")
            if compiled:
                start = time.perf_counter()
                fns["stepahead_compiled"] = runner_step(path, batch, n, compile=True)
                print(f"  ({name} batch {batch}: compiled runner built and warmed up in "
                      f"{time.perf_counter() - start:.1f} s)", flush=True)
            fns |= {"hf": hf_step(path, batch), "floor": floor_step(path, batch),
                    "floor_packed": floor_step(path, batch, packed=True),
                    "floor_kv": floor_step(path, batch, kv=True)}
            rounds = [_time_round(fns, warmup, steps) for _ in range(repeat)]
            row = {"model": name, "batch": batch, "kv_tokens": KV_TOKENS, "rounds": repeat}
            for key in fns:
                row[f"{key}_ms"] = 1e3 * statistics.median(t[key] for t in rounds)
            for key in (k for k in STEPAHEAD if k in fns):
                suffix = key.removeprefix("stepahead")
                row[f"vs_hf{suffix}"] = statistics.median(t[key] / t["hf"] for t in rounds)
                row[f"vs_floor{suffix}"] = statistics.median(t[key] / t["floor"] for t in rounds)
                row[f"vs_floor_packed{suffix}"] = statistics.median(t[key] / t["floor_packed"] for t in rounds)
                row[f"vs_floor_kv{suffix}"] = statistics.median(t[key] / t["floor_kv"] for t in rounds)
            print(_fmt(row), flush=True)
            rows.append(row)
            done(rows)
    return rows


def _fmt(row: dict) -> str:
    cells = [f"{row['model']:>12} {row['batch']:>5}"]
    for key in (*STEPAHEAD, "hf", "floor", "floor_packed", "floor_kv"):
        if f"{key}_ms" in row:
            cells.append(f"{key}={row[f'{key}_ms']:.2f}ms")
    for key in STEPAHEAD:
        suffix = key.removeprefix("stepahead")
        if f"vs_hf{suffix}" in row:
            cells.append(f"{key}: {row[f'vs_hf{suffix}']:.2f}x hf {row[f'vs_floor{suffix}']:.2f}x floor "
                         f"{row[f'vs_floor_packed{suffix}']:.2f}x packed floor "
                         f"{row[f'vs_floor_kv{suffix}']:.2f}x packed+kv floor")
    return "  ".join(cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "100m"], choices=[*sorted(SPECS), "smollm2-135m"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--repeat", type=int, default=1, help="rounds; the table shows medians over rounds")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="cpu: process CPU time, steadier on a shared machine (use with --threads 1)")
    parser.add_argument("--reference", action="store_true", help="also the torch reference attention backend")
    parser.add_argument("--compiled", action="store_true", help="also the compiled forward (--no-enforce-eager)")
    parser.add_argument("--unpacked", action="store_true",
                        help="also the runner with plain F.linear weights (--no-cpu-prepack-weights)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/forward.json"))
    args = parser.parse_args(argv)

    import os

    import torch

    global _clock
    _clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cpus; "
          f"decode step ms ({args.clock} clock), median of {args.steps} steps, {args.repeat} rounds")
    def write(rows: list[dict]) -> None:
        meta = {"clock": args.clock, "torch": torch.__version__, "threads": torch.get_num_threads(),
                "cpus": os.cpu_count(), "load_avg_after": os.getloadavg(), "argv": sys.argv[1:]}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))

    run_all(args.models, args.batches, args.warmup, args.steps, args.repeat, args.reference, args.compiled,
            args.unpacked, write)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
