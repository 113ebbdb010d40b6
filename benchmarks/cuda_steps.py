"""Decode-step time on a device: synchronous vs pipelined launches, per attention backend.

    python benchmarks/cuda_steps.py [--device cuda] [--models tiny 100m] [--batches 64 256]
                                    [--backends torch paged] [--steps 50] [--modes eager compiled graphs]
                                    [--out benchmarks/results/cuda_steps.json]

`sync`: launch step t, wait for its ids, launch t+1 (the device idles while the host
prepares each step). `pipelined`: launch t+1, then wait for t (the worker's window of
two): the host prepares step t+1 while the device runs step t, so the step time should
approach max(device time, host time). Both run the same placeholder decodes (~256 tokens
of KV per request), side by side in one process; the table shows ms per step and the
ratio sync / pipelined. Also runs on CPU (`--device cpu`) as a smoke test.

`--modes` runs each row in every mode named: `eager`; `compiled` (each decoder layer through
torch.compile, warmed up before timing; its compile time is reported); `graphs` (the eager forward's
decode steps replayed from CUDA graphs: `worker_service/decode_graphs.py`, paged backend only; on CPU
`EagerReplay`, a smoke test of the plumbing); `compiled+graphs` (what `--no-enforce-eager` runs on
CUDA). A graph is captured on its shape's first step, in the warm-up; the capture time is reported. The HBM
roofline of a decode step is its weights plus its K/V read once at the device's memory
bandwidth (`--hbm-gbps`, else looked up from the device's name: H100 SXM, H100 PCIe, H200, A100);
`vs roofline` is the pipelined step over it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from stepahead.plan import NewRequest, RunningRequest, SamplingParams, StepPlan

KV_TOKENS = 256
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)


HBM_GBPS = (("H100 PCIe", 2000.0), ("H100", 3350.0), ("H200", 4800.0), ("A100", 2039.0))  # by device name


def hbm_gbps(device: str) -> float | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((gbps for key, gbps in HBM_GBPS if key in name), None)


def step_bytes(runner, batch: int) -> int:
    """A decode step's memory floor: every weight (a packed linear's too) and each request's
    K/V of KV_TOKENS tokens, read once."""
    from worker_service.layers.packed_linear import PackedLinear

    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    weights += sum(m.in_features * m.out_features * runner.dtype.itemsize for m in runner.model.modules()
                   if isinstance(m, PackedLinear))
    cfg = runner.model.config
    kv = cfg.num_layers * batch * KV_TOKENS * 2 * cfg.num_kv_heads * cfg.head_dim * runner.dtype.itemsize
    return weights + kv


MODES = ("eager", "compiled", "graphs", "compiled+graphs")


def make_runner(model: str, device: str, backend: str, batch: int, dtype: str, mode: str = "eager"):
    from model_zoo.builtin_models import resolve_model
    from worker_service.attention_names import AttentionBackendName
    from worker_service.decode_graphs import CudaGraph, EagerReplay, GraphSettings, graph_sizes
    from worker_service.loader import parse_dtype
    from worker_service.model_runner import ModelRunner
    from worker_service.paged_attention import make_backend

    per = KV_TOKENS // BLOCK + 8
    graphs = None
    if "graphs" in mode:
        graphs = GraphSettings(graph_sizes((), 512, batch), CudaGraph if device.startswith("cuda") else EagerReplay)
    return ModelRunner(resolve_model(model), device=device, dtype=dtype, block_size=BLOCK,
                       num_blocks=batch * per, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch),
                       attention_backend=make_backend(AttentionBackendName(backend), torch.device(device),
                                                      parse_dtype(dtype), BLOCK),
                       enforce_eager="compiled" not in mode, pad_decode_batches=True, decode_graphs=graphs)


def prime(runner, batch: int) -> int:
    """Registers `batch` requests as prefix hits and runs their first sampling step."""
    runner.reset()
    per = KV_TOKENS // BLOCK + 8
    new = tuple(NewRequest(f"r{i}", tuple(range(1, KV_TOKENS + 1)), GREEDY, tuple(range(i * per, (i + 1) * per)),
                           KV_TOKENS - 1, 1) for i in range(batch))
    runner.execute(StepPlan(0, new_requests=new))
    return 1


def decode(step: int, batch: int) -> StepPlan:
    return StepPlan(step, running=tuple(RunningRequest(f"r{i}", (), 1, True) for i in range(batch)))


def run(runner, batch: int, steps: int, pipelined: bool) -> float:
    step = prime(runner, batch)
    sync = (lambda: torch.cuda.synchronize()) if runner.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    pending = None
    for _ in range(steps):
        launched = runner.launch(decode(step, batch))
        step += 1
        if pipelined:
            if pending is not None:
                pending.wait()
            pending = launched
        else:
            launched.wait()
    if pending is not None:
        pending.wait()
    sync()
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--models", nargs="+", default=["tiny", "100m"])
    ap.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    ap.add_argument("--backends", nargs="+", default=["torch", "paged"], help="torch, paged, flashinfer")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default="benchmarks/results/cuda_steps.json")
    ap.add_argument("--modes", nargs="+", default=["eager"], choices=MODES, help="each row in these modes")
    ap.add_argument("--hbm-gbps", type=float, default=None, help="memory bandwidth (default: by device name)")
    args = ap.parse_args()
    gbps = args.hbm_gbps or hbm_gbps(args.device)
    rows = []
    print(f"{'model':6} {'backend':8} {'mode':15} {'batch':>5} {'sync ms':>9} {'pipelined ms':>13} {'ratio':>6} "
          f"{'roofline ms':>11} {'vs roofline':>11}")
    for model in args.models:
        for backend in args.backends:
            for batch in args.batches:
                for mode in args.modes:
                    if "graphs" in mode and backend != "paged":
                        continue  # graphs need the graph-safe backend
                    start = time.perf_counter()
                    try:
                        runner = make_runner(model, args.device, backend, batch, args.dtype, mode)
                    except ValueError as exc:  # a backend this machine cannot run (flashinfer not installed)
                        print(f"{model:6} {backend:8} {mode:15} {batch:5d}  skipped: {exc}")
                        continue
                    build_s = time.perf_counter() - start
                    run(runner, batch, 5, pipelined=True)  # warm-up (captures the step's graph)
                    sync_ms = run(runner, batch, args.steps, pipelined=False)
                    pipe_ms = run(runner, batch, args.steps, pipelined=True)
                    floor_ms = step_bytes(runner, batch) / (gbps * 1e9) * 1e3 if gbps else None
                    graphs = runner.graphs
                    rows.append(dict(model=model, backend=backend, mode=mode, batch=batch, sync_ms=sync_ms,
                                     pipelined_ms=pipe_ms, roofline_ms=floor_ms, build_s=build_s,
                                     warm_up_s=runner.warm_up_seconds,
                                     graphs_captured=graphs.num_captured if graphs else 0,
                                     graph_capture_s=graphs.capture_seconds if graphs else 0.0,
                                     graph_replays=graphs.num_replays if graphs else 0))
                    floor = f"{floor_ms:11.3f} {pipe_ms / floor_ms:11.2f}" if floor_ms else f"{'-':>11} {'-':>11}"
                    notes = []
                    if "compiled" in mode:
                        notes.append(f"compiled in {runner.warm_up_seconds:.1f} s")
                    if graphs:
                        notes.append(f"{graphs.num_captured} graph(s) captured in {graphs.capture_seconds:.2f} s, "
                                     f"{graphs.num_replays} replays")
                    print(f"{model:6} {backend:8} {mode:15} {batch:5d} {sync_ms:9.3f} {pipe_ms:13.3f} "
                          f"{sync_ms / pipe_ms:6.2f} {floor}" + (f"  ({'; '.join(notes)})" if notes else ""))
                    del runner
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(device=args.device, dtype=args.dtype, kv_tokens=KV_TOKENS,
                                              steps=args.steps, hbm_gbps=gbps, rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
