"""Chaos soak: many concurrent streams against sim workers while daemons are killed.

    python benchmarks/soak.py --duration 600 --streams 1000 --out benchmarks/results/soak.json

One scheduler, `--workers` sim workers and `--gateways` gateways run as real processes on
127.0.0.1. `--streams` client threads each loop for `--duration` seconds: send a request
(random prompt, seeded sampling, so the sim reference gives its exact tokens), read it,
sometimes slowly (a slow consumer), sometimes aborting it midway (a client that cancels).
Every `--kill-every` seconds a worker or a gateway is SIGKILLed and started again.

Reported: requests completed, cut by a gateway kill (the client's own connection died),
aborted by the client, past the client's own 120 s deadline (the system saturated), lost (a client that stayed but did not get its whole output: must be
0), tokens duplicated or wrong against the sim reference (0), blocks leaked at the end (0),
and RSS / threads / open fds of each daemon at the start and at the end.

`--sample-every S` adds the scheduler's RSS every S seconds (a timeline: the scheduler is
never killed, so its growth is visible). `--heap-probe` starts tracemalloc in the scheduler
(a `sitecustomize` on its PYTHONPATH) and has it write, at each sample, the memory Python
has allocated, the live objects by type and the largest allocation sites to
`<out dir>/soak-heap-<pid>.jsonl`: Python objects that grow show there; RSS growing while
they stay flat is the C heap (glibc arenas, fragmentation). `MALLOC_ARENA_MAX` and other
environment variables pass through to every daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from model_zoo.builtin_models import resolve_model
from testing.local_cluster import LocalCluster, process_usage
from stepahead.plan import SamplingParams
from stepahead.v1 import common_pb2, generation_pb2, generation_pb2_grpc

SEED, EOS_P = 7, 0.02


def fast_profile(directory: Path) -> Path:
    """A sim profile 1000x faster than an H200: steps of microseconds (the control plane is
    what is soaked, not the cost model)."""
    path = directory / "soak-profile.json"
    path.write_text(json.dumps({"memory_bytes": 141e9, "memory_bandwidth": 4.8e15, "peak_flops": 989e15,
                                "host_link_bandwidth": 64e12, "step_overhead_s": 1e-5}))
    return path


class Client(threading.Thread):
    """One stream slot: requests back to back until the deadline."""

    def __init__(self, index: int, stubs, reference, vocab: int, deadline: float, tally: Counter, lock) -> None:
        super().__init__(daemon=True)
        self.rng = random.Random(index)
        self.stubs, self.reference, self.vocab = stubs, reference, vocab
        self.deadline, self.tally, self.lock = deadline, tally, lock
        self.failures: list[str] = []

    def run(self) -> None:
        while time.monotonic() < self.deadline:
            self._one()

    def _one(self) -> None:
        rng = self.rng
        prompt = [rng.randrange(5, self.vocab) for _ in range(rng.randint(4, 48))]
        sampling = SamplingParams(temperature=1.0, max_tokens=rng.randint(8, 64), seed=rng.randrange(1 << 30))
        abort_after = rng.randint(1, 6) if rng.random() < 0.1 else None
        slow = rng.random() < 0.1
        request = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=sampling.max_tokens, seed=sampling.seed))
        tokens, last = [], None
        call = self.stubs[rng.randrange(len(self.stubs))].Generate(request, timeout=120)
        try:
            for i, msg in enumerate(call):
                tokens += msg.token_ids
                last = msg
                if abort_after is not None and i + 1 >= abort_after:
                    call.cancel()
                    self._count("aborted_by_client")
                    return
                if slow:
                    time.sleep(0.01)  # a slow consumer, not synchronisation
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and abort_after is not None:
                self._count("aborted_by_client")
            elif exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._count("cut_by_gateway_kill")
            elif exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._count("client_deadline_exceeded")  # the client gave up (saturation), reported apart
            else:
                self._fail(f"{exc.code().name}: {exc.details()}")
            return
        want = self.reference(prompt, sampling)
        if last is None or last.finish_reason not in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH):
            self._fail(f"ended with {last.finish_reason if last else 'nothing'} after {len(tokens)} tokens")
        elif tokens != want:
            extra = len(tokens) - len(set(enumerate(tokens)) & set(enumerate(want)))
            self._count("tokens_wrong_or_duplicated", extra)
            self._fail(f"{len(tokens)} tokens, want {len(want)}")
        else:
            self._count("completed")
            self._count("tokens_streamed", len(tokens))

    def _count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.tally[key] += n

    def _fail(self, why: str) -> None:
        self._count("lost")
        self.failures.append(why)


HEAP_PROBE = """
import gc, json, os, sys, threading, time, tracemalloc
from collections import Counter

if "scheduler" in sys.argv[1:3]:
    tracemalloc.start(1)
    _path = os.path.join(os.environ["STEPAHEAD_SOAK_PROBE_DIR"], f"soak-heap-{os.getpid()}.jsonl")
    _every = float(os.environ["STEPAHEAD_SOAK_PROBE_EVERY"])
    _start = time.monotonic()

    def _sample():
        while True:
            time.sleep(_every)  # a sampling period of a diagnostic probe, not synchronisation
            types = Counter(type(o).__name__ for o in gc.get_objects())
            top = tracemalloc.take_snapshot().statistics("lineno")[:15]
            current, peak = tracemalloc.get_traced_memory()
            with open(_path, "a") as f:
                f.write(json.dumps({
                    "t_s": round(time.monotonic() - _start, 1),
                    "traced_mib": round(current / 2**20, 1), "traced_peak_mib": round(peak / 2**20, 1),
                    "gc_objects": sum(types.values()), "gc_frozen": gc.get_freeze_count(),
                    "top_types": types.most_common(12),
                    "top_sites": [[str(s.traceback[0]), round(s.size / 2**20, 2), s.count] for s in top],
                }) + "\\n")

    threading.Thread(target=_sample, name="soak-heap-probe", daemon=True).start()
"""


def install_heap_probe(directory: Path, every_s: float) -> None:
    """Put the probe on the PYTHONPATH every daemon inherits (only the scheduler runs it)."""
    probe = directory / "soak-probe"
    probe.mkdir(parents=True, exist_ok=True)
    (probe / "sitecustomize.py").write_text(HEAP_PROBE)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(probe), os.environ.get("PYTHONPATH")]))
    os.environ["STEPAHEAD_SOAK_PROBE_DIR"] = str(directory.resolve())
    os.environ["STEPAHEAD_SOAK_PROBE_EVERY"] = str(every_s)


class Sampler(threading.Thread):
    """The scheduler's RSS / threads / fds every `every_s` seconds until stopped."""

    def __init__(self, pid: int, every_s: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.every_s = pid, every_s
        self.stopped = threading.Event()
        self.samples: list[dict] = []
        self._start = time.monotonic()

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            self.samples.append({"t_s": round(time.monotonic() - self._start, 1), **process_usage(self.pid)})


def soak(duration_s: float, streams: int, workers: int, gateways: int, kill_every_s: float,
         workdir: Path, seed: int = 0, model_dir: Path | None = None, sample_every_s: float = 0.0) -> dict:
    from worker_service.sim.profiles import load_profile
    from worker_service.sim.runner import SimRunner
    from worker_service.sim.tokens import reference_output

    model = model_dir or resolve_model("llama3-8b-sim")
    runner = SimRunner(model, load_profile("h200"), seed=SEED, eos_probability=EOS_P, num_blocks=64)
    cluster = LocalCluster(model, fast_profile(workdir), workers=workers, gateways=gateways,
                           worker_flags=["--sim-eos-probability", str(EOS_P), "--seed", str(SEED)])
    tally, lock = Counter(), threading.Lock()
    try:
        cluster.wait_ready()
        usage_start = cluster.usage()
        sampler = Sampler(cluster.members["scheduler"].pid, sample_every_s) if sample_every_s > 0 else None
        if sampler is not None:
            sampler.start()
        channels = [grpc.insecure_channel(a) for a in cluster.gateway_addresses]
        stubs = [generation_pb2_grpc.GenerationStub(ch) for ch in channels]
        deadline = time.monotonic() + duration_s
        clients = [Client(i, stubs, lambda p, s: reference_output(runner.rule, p, s, runner.max_model_len),
                          runner.vocab_size, deadline, tally, lock) for i in range(streams)]
        for c in clients:
            c.start()
        kills = _chaos(cluster, deadline, kill_every_s, random.Random(seed))
        for c in clients:
            c.join(timeout=180)
        leaks = cluster.leaked_blocks()
        total_blocks = cluster.stats().num_total_blocks  # every replica's pool: what the prefix cache can hold
        usage_end = cluster.usage()
        if sampler is not None:
            sampler.stopped.set()
            sampler.join()
        failures = [f for c in clients for f in c.failures]
        for ch in channels:
            ch.close()
    finally:
        cluster.close()
    return {
        "duration_s": duration_s, "streams": streams, "workers": workers, "gateways": gateways,
        "kills": kills, **{k: tally[k] for k in ("completed", "aborted_by_client", "cut_by_gateway_kill",
                                                 "client_deadline_exceeded", "lost", "tokens_wrong_or_duplicated",
                                                 "tokens_streamed")},
        "blocks_leaked": leaks, "num_total_blocks": total_blocks, "orphans": cluster.orphans(), "failures": failures[:10],
        "usage_start": usage_start, "usage_end": usage_end,
        "scheduler_timeline": sampler.samples if sampler is not None else [],
        "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),
    }


def _chaos(cluster: LocalCluster, deadline: float, every_s: float, rng: random.Random) -> list[str]:
    """Kill a worker or a gateway every `every_s` seconds (the last 10 s stay calm)."""
    kills, stop = [], threading.Event()
    while every_s > 0 and not stop.wait(every_s) and time.monotonic() < deadline - 10:
        kind = rng.choice(["worker", "gateway"])
        cluster.kill_and_restart(kind, rng)
        kills.append(kind)
    while time.monotonic() < deadline:
        stop.wait(min(1.0, max(0.0, deadline - time.monotonic())))
    return kills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--kill-every", type=float, default=30.0, help="0: no kills")
    parser.add_argument("--sample-every", type=float, default=0.0, help="scheduler RSS timeline period (0: none)")
    parser.add_argument("--heap-probe", action="store_true", help="tracemalloc and gc counts in the scheduler")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/soak.json"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.heap_probe:
        install_heap_probe(args.out.parent, args.sample_every or 30.0)
    result = soak(args.duration, args.streams, args.workers, args.gateways, args.kill_every, args.out.parent,
                  sample_every_s=args.sample_every)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("usage")}, indent=1))
    for name in result["usage_start"]:
        print(f"{name:>12}: start {result['usage_start'][name]}  end {result['usage_end'].get(name)}")
    for sample in result["scheduler_timeline"]:
        print(f"scheduler t={sample['t_s']:>6}s rss {sample['rss_mib']} MiB")


if __name__ == "__main__":
    main()


__all__ = ["process_usage", "soak"]
