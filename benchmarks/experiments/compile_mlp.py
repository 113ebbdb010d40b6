"""Does torch.compile (inductor) pay on this CPU? One SwiGLU MLP at a model's geometry, eager vs
compiled (`dynamic=True`, one compile for every batch size), single thread.

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/compile_mlp.py [--hidden 576 --intermediate 1536]
        [--batches 1 16 64] [--iters 50] [--out benchmarks/results/compile_mlp.json]

Reported: the compile time of the first call and, per batch size, µs per call of each, alternated
(eager, compiled, eager, compiled: the median of `--repeat` pairs). The default geometry is
SmolLM2-135M's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    # x [n, hidden]; w_gate, w_up [inter, hidden]; w_down [hidden, inter] -> [n, hidden]
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def per_call_us(fn, args, iters: int) -> float:
    for _ in range(3):
        fn(*args)
    start = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    w = (torch.randn(args.intermediate, args.hidden), torch.randn(args.intermediate, args.hidden),
         torch.randn(args.hidden, args.intermediate))
    compiled = torch.compile(mlp, dynamic=True)
    start = time.perf_counter()
    compiled(torch.randn(args.batches[0], args.hidden), *w)
    compile_s = time.perf_counter() - start
    rows = []
    for n in args.batches:
        x = torch.randn(n, args.hidden)
        assert torch.allclose(compiled(x, *w), mlp(x, *w), rtol=1e-4, atol=1e-3)
        pairs = [(per_call_us(mlp, (x, *w), args.iters), per_call_us(compiled, (x, *w), args.iters))
                 for _ in range(args.repeat)]
        eager, comp = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        rows.append({"batch": n, "eager_us": round(eager, 1), "compiled_us": round(comp, 1),
                     "speedup": round(eager / comp, 3)})
        print(f"batch {n:4d}: eager {eager:8.1f} us, compiled {comp:8.1f} us, speedup {eager / comp:.2f}x")
    print(f"compile time {compile_s:.1f} s")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "compile_s": compile_s,
                                        "rows": rows, "torch": torch.__version__}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
