"""What structured requests cost the other streams of a server: the pause they put in a
running plain stream.

    PYTHONPATH=. .venv/bin/python benchmarks/structured_first_request.py --model smollm2-135m --rounds 2 \
        --out benchmarks/results/structured_first_request.json

Each round starts `stepahead serve MODEL` (with this interpreter and PYTHONPATH, so
`PYTHONPATH=<checkout>` measures another checkout), streams one greedy plain completion
(`ignore_eos`, `--plain-tokens` tokens) over the gRPC API, and, once it is running, sends
`--schemas` chat requests one after another, each with a JSON schema the server has not seen
(so each compiles; `--alternatives N`: any of N objects of eight fields, the shape of a
required call among N tools, which compiles for longer), 24 output tokens each. The first of them also loads the worker's
structured-output machinery (xgrammar and the model's vocabulary). Reported per round: the
plain stream's median gap between tokens, its largest gap while the first structured
request ran and the largest while the later ones ran, and each structured request's latency.
The step that admits a structured request waits for what its grammar needs, and every stream
in that step with it, so the largest gaps are those waits.
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


def schema(i: int, alternatives: int) -> str:
    """An object schema no earlier request used (the compiled-grammar cache misses): with
    `alternatives` > 1, any of that many objects of eight typed fields (enums, arrays of
    objects, bounded integers), the shape of a required call among that many tools."""
    if alternatives <= 1:
        props = {f"field_{i}_{k}": {"type": "integer"} for k in range(4)}
        return json.dumps({"type": "object", "properties": props, "required": [f"field_{i}_0"]})
    kinds = ({"type": "string", "enum": [f"v{j}" for j in range(10)]},
             {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"},
                                                                          "y": {"type": "string"}}}},
             {"type": "integer", "minimum": 0, "maximum": 1000})
    tools = [{"type": "object", "properties": {"name": {"const": f"tool_{i}_{t}"}, "arguments": {
        "type": "object", "properties": {f"p{k}": kinds[k % 3] for k in range(8)}, "required": ["p0"]}},
        "required": ["name", "arguments"]} for t in range(alternatives)]
    return json.dumps({"anyOf": tools})


def one_round(args) -> dict:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", args.model, "--port", str(port), "--http-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        if not any(line.startswith("stepahead ready") for line in proc.stdout):
            raise SystemExit(f"serve exited with {proc.wait(30)} before it was ready")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            return _measure(generation_pb2_grpc.GenerationStub(channel), args)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def _measure(stub, args) -> dict:
    arrivals: list[float] = []
    plain = generation_pb2.GenerateRequest(
        text="Once upon a time", sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=args.plain_tokens,
                                                                    ignore_eos=True))

    def stream() -> None:
        for response in stub.Generate(plain, timeout=600):
            arrivals.extend([time.monotonic()] * max(len(response.token_ids), 1))

    reader = threading.Thread(target=stream)
    reader.start()
    while len(arrivals) < 16 and reader.is_alive():  # the plain stream is decoding
        time.sleep(0.01)
    windows = []
    for i in range(args.schemas):
        request = generation_pb2.GenerateRequest(
            chat=generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content="Give me the JSON.")]),
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=24,
                                               structured_outputs=common_pb2.StructuredOutputs(json=schema(i, args.alternatives))))
        start = time.monotonic()
        list(stub.Generate(request, timeout=600))
        windows.append((start, time.monotonic()))
    reader.join()
    gaps = [(b, b - a) for a, b in zip(arrivals, arrivals[1:])]

    def largest(start: float, end: float) -> float:
        return max((gap for at, gap in gaps if start < at <= end + 0.5), default=0.0) * 1e3

    return {"plain_tokens": len(arrivals), "median_gap_ms": statistics.median(g for _, g in gaps) * 1e3,
            "first_structured_max_gap_ms": largest(*windows[0]),
            "later_structured_max_gap_ms": max((largest(*w) for w in windows[1:]), default=None),
            "structured_latency_s": [end - start for start, end in windows]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--schemas", type=int, default=4, help="structured requests per round, each a new schema")
    parser.add_argument("--plain-tokens", type=int, default=600)
    parser.add_argument("--alternatives", type=int, default=1,
                        help="> 1: each schema is any of that many objects (a tool call's shape; compiles longer)")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    rounds = [one_round(args) for _ in range(args.rounds)]
    for r in rounds:
        print(f"plain stream: median gap {r['median_gap_ms']:.1f} ms, largest gap during the first structured request "
              f"{r['first_structured_max_gap_ms']:.0f} ms, during the later ones {r['later_structured_max_gap_ms']:.0f} ms; "
              f"structured latency {', '.join(f'{s:.2f}' for s in r['structured_latency_s'])} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
