"""What the garbage collector costs the scheduler daemon around its KV block pool.

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/scheduler_gc.py [--blocks 236000] [--rounds 3]

Two numbers, each in a fresh interpreter per round (freezing is process-wide), as the daemon
runs (`freeze_heap_on_attach`; the scripts are `testing/scheduler_heap.py`'s, which the heap
tests assert on):
- attach: a worker's hello to its acceptance by the engine with a pool of `--blocks` blocks
  (236,000 is llama3.2-1b-sim on the h200 profile), and the collections that started meanwhile
  (young, middle, full). The engine's loop, which runs every replica's steps, waits throughout.
- full collection: `gc.collect()` once every block of that pool holds a cached content (a warm
  prefix cache), best of 5: what every full collection of a long-running scheduler walks.
"""

from __future__ import annotations

import argparse

from testing import scheduler_heap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=236_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for r in range(args.rounds):
        attach, warm = scheduler_heap.attach(args.blocks), scheduler_heap.warm_cache(args.blocks)
        print(f"round {r}: attach {attach['attach_ms']:.0f} ms, collections meanwhile (young, middle, full) "
              f"{attach['collections']}; full collection with a warm cache {warm['full_collection_ms']:.1f} ms, "
              f"{warm['tracked_objects']} objects tracked", flush=True)


if __name__ == "__main__":
    main()
