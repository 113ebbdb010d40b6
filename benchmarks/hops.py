"""Where a lone request's time goes between the daemons (sim worker, idle system).

    PYTHONPATH=. .venv/bin/python benchmarks/hops.py [--sim-profile h200] [--num-requests 30] \
        [--prompt-len 512] [--out benchmarks/results/hops.json]

`stepahead serve --device sim`, then one request at a time (2 output tokens, a pause between
them so each meets an idle system): the client's send and first-token times are matched with
the flight recorder's step that first planned the request (its schedule, plan-sent and commit
times on the scheduler, receive / forward / result-sent times on the worker). Prints the p50
of each hop and the four latencies `stepahead simulate --sim-*-latency-ms` models:
ingress (client send -> the scheduler plans with it), plan (-> the device starts it), result
(step end -> result committed) and egress (commit -> the client has the token).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from stepahead import security
from cli import bench
from testing.launcher import ServeProcess
from cli.trace import fetch_records
from stepahead.v1 import generation_pb2, generation_pb2_grpc

HOPS = ("client -> scheduler plans", "schedule", "plan handed to the stream", "plan on the wire", "worker prep",
        "device", "result out of the worker", "result wire + read", "commit", "commit -> client")
MODEL = {"ingress": HOPS[:1], "plan": HOPS[1:5], "result": HOPS[6:9], "egress": HOPS[9:]}


def hops_of(send: float, first_token: float, record) -> dict[str, float]:
    """Seconds per hop of one request's first token (wall clock)."""
    w = record.worker
    marks = (send, record.schedule_start, record.schedule_end, record.plan_sent, w.plan_received, w.forward_start,
             w.forward_end, w.result_sent, record.commit_start, record.result_committed, first_token)
    return dict(zip(HOPS, (b - a for a, b in zip(marks, marks[1:]))))


def measure(model: str, profile: str, num_requests: int, prompt_len: int, seed: int = 0) -> dict:
    """p50 of every hop and of the four modelled latencies, in ms."""
    rng = random.Random(seed)
    wall_minus_perf = time.time() - time.perf_counter()  # the client times with perf_counter
    with ServeProcess(model, "--device", "sim", "--sim-profile", profile) as serve:
        with security.channel(serve.gateway_addr) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            vocab = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=30).vocab_size
            bench.one_request(stub, bench.WorkItem([1, 2, 3], 2), True)  # warm-up, not measured
            sent = []
            for _ in range(num_requests):
                prompt = [rng.randrange(1, vocab) for _ in range(prompt_len)]
                m = bench.one_request(stub, bench.WorkItem(prompt, 2), True)
                if m.error:
                    raise SystemExit(f"request failed: {m.error}")
                sent.append((m.start + wall_minus_perf, m.first_token + wall_minus_perf))
                time.sleep(0.05)  # spacing only: the next request meets an idle system
        _, records = fetch_records(serve.scheduler_addr, serve.cluster_token)
    records.sort(key=lambda r: r.schedule_start)
    rows = [hops_of(send, first, next(r for r in records if r.schedule_start >= send)) for send, first in sent]
    p50 = {k: statistics.median(r[k] for r in rows) * 1e3 for k in HOPS}
    model_ms = {k: statistics.median(sum(r[h] for h in hops) for r in rows) * 1e3 for k, hops in MODEL.items()}
    ttft = statistics.median(sum(r.values()) for r in rows) * 1e3
    return {"hops_p50_ms": p50, "latencies_ms": model_ms, "ttft_p50_ms": ttft, "num_requests": num_requests,
            "prompt_len": prompt_len, "sim_profile": profile, "model": model}


def simulate_flags(latencies_ms: dict[str, float]) -> list[str]:
    """The `stepahead simulate` flags that model these latencies."""
    return [f for k, v in latencies_ms.items() for f in (f"--sim-{k}-latency-ms", f"{v:.3f}")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sim-profile", default="h200")
    parser.add_argument("--model", default="llama3-8b-sim")
    parser.add_argument("--num-requests", type=int, default=30)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = measure(args.model, args.sim_profile, args.num_requests, args.prompt_len)
    for k, v in result["hops_p50_ms"].items():
        print(f"{k:<28}{v:8.2f} ms")
    print(f"{'TTFT':<28}{result['ttft_p50_ms']:8.2f} ms")
    print("stepahead simulate", " ".join(simulate_flags(result["latencies_ms"])))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
