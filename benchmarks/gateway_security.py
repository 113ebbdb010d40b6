"""What TLS and API keys cost the gateway, and the largest burst it absorbs.

    python benchmarks/gateway_security.py --out benchmarks/results/gateway_security.json

Part 1, side by side in one run: the same streamed workload (sim worker with a fast profile,
so the device is never the limit) through a gateway that is plain, that checks an API key,
and that checks an API key over TLS; over gRPC and over HTTP (SSE). Reported: the gateway
process's CPU seconds per streamed token (user + system, from /proc), and the client's
wall time.

Part 2: bursts of N concurrent gRPC streams opened at once (grpc.aio, one client thread)
against a gateway with the default stream limit (1024): how many finished, how many were
refused with RESOURCE_EXHAUSTED (explained), and how many failed any other way
(unexplained: must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from benchmarks.machine import cpu_seconds
from stepahead import security
from model_zoo.builtin_models import resolve_model
from testing.local_cluster import LocalCluster
from stepahead.ports import free_port
from stepahead.v1 import common_pb2, generation_pb2, generation_pb2_grpc



def fast_profile(directory: Path) -> Path:
    path = directory / "fast.json"
    path.write_text(json.dumps({"memory_bytes": 141e9, "memory_bandwidth": 4.8e15, "peak_flops": 989e15,
                                "host_link_bandwidth": 64e12, "step_overhead_s": 1e-5}))
    return path


def make_certs(directory: Path):
    """The test suite's certificate factory (a CA, a server and a client certificate)."""
    from testing.certs import make_certs as make

    return make(directory)


def request(i: int, max_tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=[5 + i % 50, 6, 7, 8]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def grpc_load(address: str, key: str | None, tls, streams: int, max_tokens: int) -> int:
    with security.channel(address, api_key=key, tls=tls) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        list(stub.Generate(request(0, 2), timeout=60, wait_for_ready=True))  # warm-up

        def one(i: int) -> int:
            return sum(len(m.token_ids) for m in stub.Generate(request(i, max_tokens), timeout=300))

        with ThreadPoolExecutor(streams) as pool:
            return sum(pool.map(one, range(streams)))


def http_load(url: str, key: str | None, ca: str | None, streams: int, max_tokens: int) -> int:
    import httpx2 as httpx  # the HTTP client the openai package ships with

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "llama3-8b-sim", "prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}

    def one(i: int) -> int:
        n = 0
        with httpx.Client(verify=ca or True, timeout=300) as client:
            with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
                for line in r.iter_lines():
                    n += line.startswith("data: {")
        return n

    one(0)  # warm-up
    with ThreadPoolExecutor(streams) as pool:
        return sum(pool.map(one, range(streams)))


def cost(args, workdir: Path) -> list[dict]:
    certs = make_certs(workdir)
    configs = {
        "plain": ([], {}),
        "api_key": ([], {"STEPAHEAD_API_KEY": "k"}),
        "api_key+tls": (["--ssl-certfile", str(certs.server_cert), "--ssl-keyfile", str(certs.server_key)],
                        {"STEPAHEAD_API_KEY": "k"}),
    }
    rows = []
    for name, (flags, env) in configs.items():
        http_port = free_port()
        cluster = LocalCluster(resolve_model("llama3-8b-sim"), fast_profile(workdir), workers=1, gateways=1,
                               gateway_flags=[*flags, "--http-port", str(http_port)], gateway_env=env)
        try:
            cluster.wait_ready(gateways=False)
            key = env.get("STEPAHEAD_API_KEY")
            tls = security.TLSFiles(ca_certs=str(certs.ca)) if flags else None
            address = cluster.gateway_addresses[0].replace("127.0.0.1", "localhost")
            scheme = "https" if flags else "http"
            pid = cluster.members["gateway0"].pid
            for transport in ("grpc", "http"):
                before, start = cpu_seconds(pid), time.perf_counter()
                if transport == "grpc":
                    tokens = grpc_load(address, key, tls, args.streams, args.max_tokens)
                else:
                    tokens = http_load(f"{scheme}://localhost:{http_port}", key, str(certs.ca) if flags else None,
                                       args.streams, args.max_tokens)
                wall, cpu = time.perf_counter() - start, cpu_seconds(pid) - before
                rows.append({"config": name, "transport": transport, "tokens": tokens, "wall_s": round(wall, 2),
                             "gateway_cpu_s": round(cpu, 2), "gateway_cpu_us_per_token": round(cpu / tokens * 1e6, 1)})
                print(rows[-1], flush=True)
        finally:
            cluster.close()
    return rows


async def _burst(address: str, n: int, max_tokens: int) -> Counter:
    outcome: Counter = Counter()
    async with grpc.aio.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def one(i: int) -> None:
            try:
                last = None
                async for msg in stub.Generate(request(i, max_tokens), timeout=300):
                    last = msg
                outcome["finished" if last and last.finish_reason else "cut"] += 1
            except grpc.aio.AioRpcError as exc:
                explained = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                outcome["refused_resource_exhausted" if explained else f"unexplained_{exc.code().name}"] += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return outcome


def bursts(args, workdir: Path) -> list[dict]:
    rows = []
    cluster = LocalCluster(resolve_model("llama3-8b-sim"), fast_profile(workdir), workers=1, gateways=1,
                           gateway_flags=["--max-concurrent-streams", str(args.stream_limit)])
    try:
        cluster.wait_ready()
        for n in args.bursts:
            start = time.perf_counter()
            outcome = asyncio.run(_burst(cluster.gateway_addresses[0], n, args.burst_tokens))
            rows.append({"burst": n, **outcome, "wall_s": round(time.perf_counter() - start, 2)})
            print(rows[-1], flush=True)
    finally:
        cluster.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--bursts", type=int, nargs="*", default=[500, 1000, 2000, 3000])
    parser.add_argument("--burst-tokens", type=int, default=32)
    parser.add_argument("--stream-limit", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gateway_security.json"))
    parser.add_argument("--bursts-only", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {"cost": [] if args.bursts_only else cost(args, Path(tmp)), "bursts": bursts(args, Path(tmp))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
