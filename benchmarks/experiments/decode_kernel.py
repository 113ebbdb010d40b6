"""One layer's decode attention: the CPU paged-decode kernel against the torch reference (gather
each request's blocks in cache-sized chunks, then SDPA), SmolLM2-135M's geometry by default.

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/decode_kernel.py [--reqs 64] [--keys 256]
        [--layers 12] [--scatter] [--pages worker|small|shared] [--threads 1] [--iters 20] [--rounds 5]

Process CPU time per call, alternating, the median of `--rounds`: the kernel (its AVX-512 loop
where the build has one), its portable loop (`portable`), the reference, and a plain read of the
caches (`read_all`) as the memory floor of the layer's K/V. With `--layers 1` one layer's K/V
stays in a large L3 across calls, so this measures the kernels' compute; with `--layers N` each
call reads the next of N layers' K/V, which together exceed the L3 as a decode step's do (each
layer's K/V is evicted by the others' and by the weights before the next step reads it), so
this measures the kernel against DRAM. `--scatter` draws each request's blocks at random from
the pool, as a server's allocations end up after requests come and go, where the default gives
each request consecutive blocks (a fresh pool; `benchmarks/forward.py`'s setup). Both passes of
the kernel ask for their key rows ahead (`PREFETCH_KEYS`, in `csrc/paged_decode_cpu.cpp`) on
calls over more K/V than the caches hold; the hardware's prefetchers alone fall behind, most of
all on scattered blocks. `--pages`: the caches allocated as the worker allocates its KV
cache (`worker`: `kv_cache.zeros`, a private mapping that asks for transparent huge pages), as
plain tensors (`small`: malloc's pages, 4 KiB where the kernel gives huge pages only on
request), or as a shared anonymous mapping (`shared`: `mmap`'s default, how the worker allocated
it before, shmem's 4 KiB pages). Compare them in separate processes, alternating (a worker holds
one cache): allocated side by side in one process their differences did not show.
"""

from __future__ import annotations

import argparse
import itertools
import math
import mmap
import statistics
import time

import torch

from worker_service import cpu_kernels, kv_cache
from worker_service.attention import TorchAttentionBackend
from worker_service.attention import AttentionMetadata


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reqs", type=int, default=64)
    parser.add_argument("--keys", type=int, default=256)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=1, help="layers' K/V read in turn (1: cache-resident)")
    parser.add_argument("--scatter", action="store_true", help="each request's blocks drawn at random from the pool")
    parser.add_argument("--pages", choices=["worker", "small", "shared"], default="worker",
                        help="the caches' memory: the worker's allocation, malloc's, or a shared mapping")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n, bs, d = args.reqs, args.block_size, args.head_dim
    per_req = -(-args.keys // bs)
    shape = (n * per_req + 1, bs, args.kv_heads, d)

    def cache(pages: str) -> torch.Tensor:
        if pages == "small":
            return torch.randn(shape)
        if pages == "shared":
            count = math.prod(shape)
            buffer = mmap.mmap(-1, count * 4)  # MAP_SHARED: the tensor keeps it alive
            buffer.madvise(mmap.MADV_HUGEPAGE)
            return torch.frombuffer(buffer, dtype=torch.float32, count=count).view(shape).copy_(torch.randn(shape))
        return kv_cache.zeros(shape, torch.float32, torch.device("cpu")).copy_(torch.randn(shape))

    caches = [(cache(args.pages), cache(args.pages)) for _ in range(args.layers)]
    order = torch.randperm(n * per_req) if args.scatter else torch.arange(n * per_req)
    tables = order.view(n, per_req).contiguous()
    lens = torch.full((n,), args.keys)
    q = torch.randn(n, args.heads, d)
    empty = torch.zeros(0, dtype=torch.int64)
    meta = AttentionMetadata(slot_mapping=empty, positions=lens - 1, block_tables=tables, seq_lens=lens,
                             num_decodes=n, max_decode_kv=args.keys, decode_uniform=True,
                             prefill_token_index=empty.view(0, 0), prefill_rows=empty, max_prefill_kv=0)
    reference = TorchAttentionBackend()
    kernel = cpu_kernels.load()
    layer = itertools.cycle(caches)
    fns = {"reference": lambda: reference.attend(q, *next(layer), meta, d**-0.5),
           "kernel": lambda: cpu_kernels.paged_decode(kernel, q, *next(layer), tables, lens, d**-0.5, None, None,
                                                      None),
           "portable": lambda: cpu_kernels.paged_decode(kernel, q, *next(layer), tables, lens, d**-0.5, None,
                                                        None, None, vectorized=False),
           "read_all": lambda: [c.sum() for c in next(layer)]}
    k_cache, v_cache = caches[0]
    torch.testing.assert_close(
        cpu_kernels.paged_decode(kernel, q, k_cache, v_cache, tables, lens, d**-0.5, None, None, None),
        reference.attend(q, k_cache, v_cache, meta, d**-0.5), rtol=1e-5, atol=1e-5)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            fn()
            start = time.process_time()
            for _ in range(args.iters * args.layers):
                fn()
            times[name].append((time.process_time() - start) / (args.iters * args.layers) * 1e3)
    kv_mb = 2 * k_cache.numel() * 4 / 2**20
    print(f"{n} requests x {args.keys} keys, {args.heads}/{args.kv_heads} heads, d {d}; K+V {kv_mb:.1f} MiB per "
          f"layer, {args.layers} layer(s), blocks {'scattered' if args.scatter else 'in order'}, pages {args.pages}; "
          f"{args.threads} thread(s)")
    for name, t in times.items():
        ms = statistics.median(t)
        print(f"  {name:>10} {ms:7.3f} ms per layer  {ms * 1e6 / (n * args.keys):6.1f} ns per request and key")


if __name__ == "__main__":
    main()
