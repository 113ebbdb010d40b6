"""Where `stepahead serve`'s start-up goes: from the command to the first served request.

    PYTHONPATH=. .venv/bin/python benchmarks/startup.py --model smollm2-135m --rounds 3 \
        --out benchmarks/results/startup_smollm2-135m.json

Each round starts `stepahead serve MODEL` (the model already converted and cached, the CPU
kernel already built: a warm start, as on every start after the first), reads the daemons'
JSON logs, sends one greedy request of one token once serve prints that it is ready, and stops
it. Reported per round, in seconds after the command: each daemon's first log line (its
Python and library imports are done), the worker's `model_loaded` (weights loaded, KV cache
allocated, warmed up) and `attached`, the scheduler's `worker_attached`, serve's "ready" line,
and the first request's answer; the medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from stepahead.ports import free_port
from stepahead.v1 import common_pb2, generation_pb2, generation_pb2_grpc

# (daemon, event) -> the phase it ends; None: the daemon's first line of any event
PHASES = (
    ("scheduler_up", "scheduler", None),
    ("gateway_up", "gateway", None),
    ("worker_up", "worker", None),
    ("worker_model_loaded", "worker", "model_loaded"),
    ("worker_attached", "worker", "attached"),
    ("scheduler_saw_worker", "scheduler", "worker_attached"),
)


def one_round(model: str, extra: list[str]) -> dict:
    port = free_port()
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", model, "--port", str(port), "--http-port", "0",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[dict] = []

    def read_logs() -> None:
        for line in proc.stderr:
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue

    reader = threading.Thread(target=read_logs, daemon=True)
    reader.start()
    ready = None
    for line in proc.stdout:
        if line.startswith("stepahead ready"):
            ready = time.time() - start
            break
    if ready is None:
        proc.wait(timeout=30)
        raise SystemExit(f"serve exited with {proc.returncode} before it was ready")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = generation_pb2.GenerateRequest(
            text="The capital of France is", sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=1))
        list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120))
    first = time.time() - start
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    reader.join(timeout=10)
    row = {"ready": ready, "first_request_answered": first}
    for name, daemon, event in PHASES:
        stamps = [_epoch(e["timestamp"]) for e in lines
                  if e.get("daemon") == daemon and (event is None or e.get("event") == event) and "timestamp" in e]
        row[name] = min(stamps) - start if stamps else None
    return row


def _epoch(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve-args", default="", help="extra serve flags, one string")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    rounds = [one_round(args.model, args.serve_args.split()) for _ in range(args.rounds)]
    keys = [name for name, *_ in PHASES] + ["ready", "first_request_answered"]
    median = {k: statistics.median(r[k] for r in rounds if r[k] is not None) for k in keys}
    for k in keys:
        print(f"{k:>24}: {median[k]:6.2f} s  ({', '.join(f'{r[k]:.2f}' for r in rounds if r[k] is not None)})")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "rounds": rounds, "median": median}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
