"""The prefix cache's host tier (`--kv-offloading-size`) on a multi-turn chat workload, in
the offline simulator (`stepahead simulate`'s `VirtualSystem`: the real scheduler core, the
sim worker's cost model, a virtual clock).

    PYTHONPATH=. .venv/bin/python benchmarks/kv_offload.py --out benchmarks/results/kv_offload.json

Workload: `--conversations` chats start at random (Poisson, `--start-rate` per second); each
runs `--turns` turns, and every turn resends the conversation so far (the previous prompt,
the model's reply as it was generated, and a new user message of ~`--user-tokens`), arriving
`--think-time` seconds after the previous reply ended (a closed loop). Replies are
`--output-tokens` long (EOS ignored). The device pool (`--num-gpu-blocks`) is too small to keep
every conversation's blocks between turns, so without a host tier an evicted conversation is
prefilled again; with it, evicted blocks were copied to host memory and are copied back (PCIe,
`host_link_bandwidth` of the profile, charged to the step) on the next turn's prefix hit.

Reported per run (host tier off / on, the same workload and seed): TTFT p50 / p99 over the
turns after the first (first turns have nothing cached either way) and over all, TPOT p50,
prompt tokens prefilled (prompt tokens minus prefix hits), host-tier hit tokens, offloaded
blocks, host evictions, and the simulated duration. Goal (issue 31): TTFT p50 >= 2x lower
with the host tier.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from cli import simulate
from scheduler_service.server import SchedulerDaemonConfig
from stepahead import config as cfg
from stepahead.plan import SamplingParams


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b-sim")
    p.add_argument("--sim-profile", default="h200")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--user-tokens", type=int, default=300, help="mean new user tokens a turn (uniform 0.5x-1.5x)")
    p.add_argument("--output-tokens", type=int, default=120)
    p.add_argument("--think-time", type=float, default=4.0, help="seconds between a reply and the next turn")
    p.add_argument("--start-rate", type=float, default=4.0, help="conversations started per second (Poisson)")
    p.add_argument("--num-gpu-blocks", type=int, default=3000, help="device KV blocks of 16 tokens")
    p.add_argument("--kv-offloading-size", type=float, default=16.0, help="GiB of host tier in the 'on' run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    return p.parse_args(argv)


def run(args, offload_gib: float) -> dict:
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    ns = parser.parse_args(["--model", args.model, "--sim-profile", args.sim_profile,
                            "--num-gpu-blocks-override", str(args.num_gpu_blocks),
                            "--kv-offloading-size", str(offload_gib), "--swap-space", "1"])
    config = simulate.SimulateConfig(**{**vars(cfg.from_args(simulate.SimulateConfig, ns)), "dataset_path": "-"})
    runner, sched_config, info = simulate.build(config, cfg.from_args(SchedulerDaemonConfig, ns))
    system = simulate.VirtualSystem(runner, sched_config)
    rng = random.Random(args.seed)
    vocab = runner.vocab_size
    user = [[[rng.randrange(3, vocab) for _ in range(rng.randint(args.user_tokens // 2, args.user_tokens * 3 // 2))]
             for _ in range(args.turns)] for _ in range(args.conversations)]
    turn_of: dict[str, tuple[int, int]] = {}
    logs: list[simulate.SimRequestLog] = []
    turns: list[int] = []  # per log index

    def request(conv: int, turn: int, prompt: tuple[int, ...], at: float):
        from scheduler_service.core.request import Request

        rid = f"c{conv}-t{turn}"
        turn_of[rid] = (conv, turn)
        log = simulate.SimRequestLog(len(logs), at, len(prompt), 0, args.output_tokens)
        logs.append(log)
        turns.append(turn)
        sampling = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
        return at, Request(rid, prompt, sampling), log

    def next_turn(req, log):
        conv, turn = turn_of[req.request_id]
        if turn + 1 == args.turns:
            return None
        prompt = req.prompt_token_ids + tuple(req.output_token_ids) + tuple(user[conv][turn + 1])
        return request(conv, turn + 1, prompt, log.finish + args.think_time)

    starts, t = [], 0.0
    for conv in range(args.conversations):
        t += rng.expovariate(args.start_rate)
        starts.append(request(conv, 0, tuple(user[conv][0]), t))
    system.run(starts, follow_up=next_turn)
    stats = system.scheduler.stats()
    later = [log for log in logs if turns[log.index] > 0]
    prompt_tokens = sum(log.prompt_len for log in logs)
    duration = max(log.finish for log in logs) - min(log.arrival for log in logs)
    return {
        "kv_offloading_size_gib": offload_gib, "num_host_blocks": info.num_host_blocks,
        "num_offload_blocks": info.num_offload_blocks, "num_device_blocks": info.num_device_blocks,
        "requests": len(logs), "duration_s": duration,
        "later_turns": simulate.request_latencies(later), "all_turns": simulate.request_latencies(logs),
        "prompt_tokens": prompt_tokens, "prefix_hit_tokens": stats.prefix_hit_tokens,
        "prefilled_tokens": prompt_tokens - stats.prefix_hit_tokens,
        "prefix_host_hit_tokens": stats.prefix_host_hit_tokens, "num_offloaded_blocks": stats.num_offloaded_blocks,
        "num_host_evictions": stats.num_host_evictions, "num_preemptions": stats.num_preemptions,
        "device_utilization": system.busy / duration,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    off, on = run(args, 0.0), run(args, args.kv_offloading_size)
    rows = []
    for name, r in (("off", off), ("on", on)):
        lt, at = r["later_turns"], r["all_turns"]
        rows.append(f"{name:>4} | TTFT p50/p99 later turns {lt['median_ttft_ms']:8.1f} / {lt['p99_ttft_ms']:8.1f} ms"
                    f" | all {at['median_ttft_ms']:8.1f} / {at['p99_ttft_ms']:8.1f} ms | TPOT p50 {at['median_tpot_ms']:6.1f} ms"
                    f" | prefilled {r['prefilled_tokens']:>8} of {r['prompt_tokens']} | host hits "
                    f"{r['prefix_host_hit_tokens']:>8} | offloaded {r['num_offloaded_blocks']:>6}"
                    f" | host evictions {r['num_host_evictions']}")
    ratio = off["later_turns"]["median_ttft_ms"] / max(on["later_turns"]["median_ttft_ms"], 1e-9)
    goal = {"goal": "TTFT p50 (turns after the first) >= 2x lower with the host tier",
            "off_ms": off["later_turns"]["median_ttft_ms"], "on_ms": on["later_turns"]["median_ttft_ms"],
            "ratio": ratio, "holds": ratio >= 2.0}
    print("\n".join(rows))
    print(json.dumps(goal))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "off": off, "on": on, "goal": goal}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
