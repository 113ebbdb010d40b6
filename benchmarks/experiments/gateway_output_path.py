"""The gateway's own Python per streamed token, without gRPC: the output path in-process.

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/gateway_output_path.py --streams 256 --output-len 256 \
        [--baseline /tmp/old-checkout] [--out benchmarks/results/gateway_output_path.json]

What `gateway_stream_cpu.py` cannot separate from grpc.aio's own cost: the real `Frontend`
(tokenizer, validation, `Generation`, `OutputProcessor`, stop strings, metrics) and the real
`LoopEvents` / `choices` / `GenerationServicer._response` chain, fed by a reader thread that
hands each step's events to the requests' sinks exactly as `SchedulerLink._read` does
(`plain_tokens.deliver`), the events encoded by the scheduler's own writer (`event_batches`:
a request's first and last token full `TokenEvent`s, the others packed plain tokens).
After a warm-up pass, each step waits until every stream consumed its event (no merging: the loop keeps up), so this
is the per-token cost at stream interval 1. Reported: CPU µs per token of the event-loop thread
(the consumers) and of the reader thread (the fan-out), from `time.thread_time`.
`--baseline DIR` runs the same measurement on another checkout in a child process (that
checkout's copy of this script: its own wire format and reader).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

TEXT = "The gateway streams every token of every request, words, spaces, numbers 3.14 and 2048, emoji 🚀, é. "


class NullLink:
    """The scheduler link's interface, with nothing upstream (the reader thread plays the scheduler)."""

    def __init__(self) -> None:
        self.sinks: dict[str, object] = {}  # request id -> its OpenRequest (the link's routes)

    def submit(self, msg, sink) -> None:
        from gateway.plain_tokens import OpenRequest

        self.sinks[msg.request_id] = OpenRequest(sink)

    def abort(self, request_id: str) -> None:
        pass

    def release(self, request_id: str) -> None:
        self.sinks.pop(request_id, None)


def measure(streams: int, output_len: int, model: str) -> dict:
    from gateway.generation import Frontend
    from gateway.plain_tokens import deliver
    from scheduler_service.event_batches import event_batches
    from scheduler_service.core.events import RequestEvent
    from stepahead.plan import FinishReason
    from gateway.metrics import GatewayMetrics
    from gateway.server import GenerationServicer
    from gateway.tokenizer import GatewayTokenizer
    from model_zoo.builtin_models import resolve_model
    from stepahead.v1 import common_pb2, generation_pb2, scheduler_pb2

    import structlog

    tokenizer = GatewayTokenizer(resolve_model(model, build=False))
    ids = tokenizer.encode(TEXT * 8, add_special_tokens=False)
    hello = scheduler_pb2.WorkerHello(model_name=model, max_model_len=8192, vocab_size=tokenizer.get_vocab_size())
    link = NullLink()
    frontend = Frontend(tokenizer, hello, link, 1 << 20, GatewayMetrics())
    servicer = GenerationServicer(frontend, structlog.get_logger())
    consumed = threading.Semaphore(0)

    class Context:
        async def abort(self, code, details, trailing_metadata=None):
            raise RuntimeError(f"{code}: {details}")

    async def client(request_id: str) -> int:
        request = generation_pb2.GenerateRequest(
            request_id=request_id, token_ids=generation_pb2.TokenIds(ids=ids[:8]),
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
        n = 0
        async for response in servicer.Generate(request, Context()):
            n += len(response.token_ids)
            consumed.release()
        return n

    def reader(loop_cpu: list[float]) -> float:
        while len(link.sinks) < streams:
            time.sleep(0.01)
        order = sorted(link.sinks)
        t0 = time.thread_time()
        for step in range(output_len):
            reason = FinishReason.LENGTH if step == output_len - 1 else None
            events = [RequestEvent(rid, (ids[step % len(ids)],), reason, 8, 0, queue_time=0.0 if step == 0 else None)
                      for rid in order]
            wire = [b.SerializeToString() for b in event_batches(events)]
            r0 = time.thread_time()
            for data in wire:  # as off the wire
                deliver(scheduler_pb2.EventBatch.FromString(data), link.sinks)
            loop_cpu.append(time.thread_time() - r0)
            for _ in order:
                consumed.acquire()
        return time.thread_time() - t0

    async def run(prefix: str) -> dict:
        fan_out: list[float] = []
        clients = [asyncio.ensure_future(client(f"{prefix}{i}")) for i in range(streams)]
        thread_cpu0 = time.thread_time()
        feeder = asyncio.ensure_future(asyncio.to_thread(reader, fan_out))
        tokens = sum(await asyncio.gather(*clients))
        loop_cpu = time.thread_time() - thread_cpu0
        await feeder
        return {"tokens": tokens, "loop_us_per_token": round(loop_cpu / tokens * 1e6, 2),
                "fan_out_us_per_token": round(sum(fan_out) / tokens * 1e6, 2)}

    async def warm_then_measure() -> dict:
        await run("warm-up-")  # imports, metric labels, first-call caches
        return await run("req-")

    return asyncio.run(warm_then_measure())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b-sim")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child mode: one measurement
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.streams, args.output_len, args.model)))
        return
    trees = {"after": Path(__file__).resolve().parents[2]}
    if args.baseline:
        trees["before"] = args.baseline.resolve()
    rows: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():  # alternating, one process each
            script = tree / "benchmarks" / "experiments" / "gateway_output_path.py"  # the checkout's own wire format
            out = subprocess.run([sys.executable, str(script), "--one", "--model", args.model, "--streams",
                                  str(args.streams), "--output-len", str(args.output_len)],
                                 env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                                 check=True)
            rows[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {name: {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in ("loop_us_per_token", "fan_out_us_per_token")}
               for name, rs in rows.items()}
    print(f"{args.streams} streams x {args.output_len} tokens, stream interval 1, medians of {args.rounds}:")
    for name, s in summary.items():
        print(f"  {name:<7} event loop {s['loop_us_per_token']:6.2f} us/token, "
              f"reader fan-out {s['fan_out_us_per_token']:5.2f} us/token")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "median": summary,
                                        "rounds": rows}, indent=2))


if __name__ == "__main__":
    main()
