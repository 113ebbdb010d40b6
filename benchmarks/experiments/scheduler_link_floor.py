"""The scheduler's CPU per step that is gRPC and thread hand-offs alone: a worker-like client
and a server that does no scheduling, sending a prebuilt 256-request plan per result.

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/scheduler_link_floor.py --rounds 5 --steps 3000 \
        --out benchmarks/results/scheduler_link_floor.json

Two servers, run alternately in fresh processes (this VM's speed drifts):
- `threads`: the scheduler daemon's structure: a sync `grpc.server`, the results read on their
  own thread into a `SimpleQueue`, an engine thread that answers each with `PlanOutbox.send`
  (the real outbox and hand-off), and the stream's generator on a pool thread writing plans.
- `aio`: one `grpc.aio` event loop reads each result and writes the next plan itself.
- `aio-unix`: the same over a Unix domain socket instead of loopback TCP.
The client keeps two plans in flight (one step ahead), like a worker. Reported: the server
process's CPU per round trip (one result in, one plan out) from /proc, and wall time per round
trip. The difference is what a scheduler running its engine on one event loop would save per
step, before any work of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import queue
import statistics
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from benchmarks.machine import cpu_seconds, python_speed_ms
from scheduler_service.links import PlanOutbox
from stepahead import codec, daemon
from stepahead.plan import StepPlan, StepResult, running_request
from stepahead.v1 import scheduler_pb2

IN_FLIGHT = 2
SERVICE, METHOD = "floor.Link", "Attach"


def prebuilt_messages(num_running: int) -> tuple[bytes, bytes]:
    """A plan of `num_running` plain decodes (a new block every 16th) and its result."""
    ids = [f"1/req-{i:08d}" for i in range(num_running)]
    running = tuple(running_request((rid, (i,) if i % 16 == 0 else (), 1, True, 0)) for i, rid in enumerate(ids))
    plan = scheduler_pb2.SchedulerMessage()
    codec.plan_to_proto(StepPlan(step_id=1, running=running), plan.plan)
    result = scheduler_pb2.WorkerMessage(result=codec.result_to_proto(
        StepResult(step_id=1, sampled_token_ids={rid: 1000 + i for i, rid in enumerate(ids)})))
    return plan.SerializeToString(), result.SerializeToString()


def _identity(b: bytes) -> bytes:
    return b


def _handler(behaviour):
    return grpc.method_handlers_generic_handler(
        SERVICE, {METHOD: grpc.stream_stream_rpc_method_handler(behaviour, _identity, _identity)})


def serve_threads(plan: bytes, port_out) -> None:
    """The scheduler daemon's structure, with nothing scheduled."""
    def attach(request_iterator, context):
        outbox, inbox = PlanOutbox(), queue.SimpleQueue()

        def read():
            for message in request_iterator:
                inbox.put(message)
            inbox.put(None)

        def engine():
            for _ in range(IN_FLIGHT):
                outbox.send(plan)
            while inbox.get() is not None:
                outbox.send(plan)
            outbox.close()

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=engine, daemon=True).start()
        yield from outbox

    daemon.tune_gil()  # as the daemons run
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((_handler(attach),))
    port_out.put(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
    server.start()
    server.wait_for_termination()


def serve_aio(plan: bytes, port_out, unix_path: str | None = None) -> None:
    """One event loop reads each result and writes the next plan (over TCP, or the Unix socket
    `unix_path`)."""
    async def attach(request_iterator, context):
        for _ in range(IN_FLIGHT):
            await context.write(plan)
        async for _ in request_iterator:
            await context.write(plan)

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_handler(attach),))
        if unix_path is None:
            port_out.put(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        else:
            server.add_insecure_port(f"unix:{unix_path}")
            port_out.put(f"unix:{unix_path}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def serve_aio_unix(plan: bytes, port_out) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        serve_aio(plan, port_out, str(Path(tmp) / "link.sock"))


SERVERS = {"threads": serve_threads, "aio": serve_aio, "aio-unix": serve_aio_unix}


def run_once(kind: str, steps: int, num_running: int) -> dict:
    plan, result = prebuilt_messages(num_running)
    port_out = mp.get_context("spawn").Queue()
    server = mp.get_context("spawn").Process(target=SERVERS[kind], args=(plan, port_out), daemon=True)
    server.start()
    try:
        channel = grpc.insecure_channel(port_out.get(timeout=30))
        grpc.channel_ready_future(channel).result(timeout=30)
        call = channel.stream_stream(f"/{SERVICE}/{METHOD}", request_serializer=_identity,
                                     response_deserializer=_identity)
        received: queue.SimpleQueue = queue.SimpleQueue()

        def results():
            for _ in range(steps):
                received.get()
                yield result

        cpu0, start, count = cpu_seconds(server.pid), time.perf_counter(), 0
        for _ in call(results()):
            count += 1
            received.put(True)
            if count == steps + IN_FLIGHT:
                break
        wall, cpu = time.perf_counter() - start, cpu_seconds(server.pid) - cpu0
        channel.close()
    finally:
        server.kill()
    return {"server": kind, "round_trips": count, "server_cpu_us_per_round_trip": cpu / count * 1e6,
            "wall_us_per_round_trip": wall / count * 1e6, "plan_bytes": len(plan), "result_bytes": len(result)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="alternating runs of each server")
    parser.add_argument("--steps", type=int, default=3000, help="round trips per run")
    parser.add_argument("--num-running", type=int, default=256, help="requests in the prebuilt plan")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = []
    for _ in range(args.rounds):
        for kind in SERVERS:
            row = run_once(kind, args.steps, args.num_running) | {"python_speed_ms": python_speed_ms()}
            print(f"{kind:8s} server CPU {row['server_cpu_us_per_round_trip']:6.1f} µs/round trip, "
                  f"wall {row['wall_us_per_round_trip']:6.1f} µs (py ms {row['python_speed_ms']:.0f})", flush=True)
            runs.append(row)
    summary = {kind: {"median_server_cpu_us": statistics.median(r["server_cpu_us_per_round_trip"] for r in runs
                                                                 if r["server"] == kind),
                      "min_server_cpu_us": min(r["server_cpu_us_per_round_trip"] for r in runs if r["server"] == kind)}
               for kind in SERVERS}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "summary": summary, "runs": runs},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
