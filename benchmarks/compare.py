"""stepahead async vs sync vs Hugging Face, same model and workload, one invocation.

    .venv/bin/python benchmarks/compare.py --model tiny --out results/compare_tiny.json

Runs, one after the other on this machine: `stepahead serve` (async scheduling) and
`stepahead serve --no-async-scheduling`, each measured by `stepahead bench`; Hugging Face
`generate_batch` (continuous batching, `ContinuousBatchingConfig`); and Hugging Face
static `generate` in batches. Every run decodes greedily with EOS ignored, so every system
produces the same number of tokens. Prints one table and writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch

from stepahead import bench
from stepahead.builtin_models import resolve_model
from stepahead.launcher import ServeProcess

ALL_CPUS = os.sched_getaffinity(0)


def workload(args) -> list[list[int]]:
    """Exactly the prompts `stepahead bench` sends."""
    return [w.prompt for w in bench.make_workload(bench_args(args, "hf", "", ""), args.vocab)]


def bench_args(args, label: str, target: str, scheduler: str, token: str) -> argparse.Namespace:
    return argparse.Namespace(
        target=target, scheduler=scheduler, cluster_token=token, num_prompts=args.num_prompts, random_input_len=args.input_len,
        random_output_len=args.output_len, random_range_ratio=args.random_range_ratio,
        request_rate=args.request_rate,
        max_concurrency=None, ignore_eos=True, seed=args.seed, label=label, disable_tqdm=False,
        dataset_name="random", dataset_path=None, trace_speedup=1.0,
        result_filename=args.out.parent / f"{args.out.stem}_{label}.json",
    )


def run_stepahead(args, label: str, *flags: str) -> dict:
    extra = args.serve_args.split()
    with ServeProcess(args.model_dir, "--dtype", args.dtype, "--max-num-seqs", str(args.num_prompts), *extra,
                      *flags) as s:
        with client_off_device_cores():
            return bench.bench(bench_args(args, label, s.gateway_addr, s.scheduler_addr, s.cluster_token))


@contextlib.contextmanager
def client_off_device_cores():
    """The benchmark client runs on the control-plane core, as a client on another host
    would not take the device's cores (set only after the server started: children
    inherit affinity)."""
    from stepahead.serve import cpu_split

    _, control = cpu_split("cpu")
    if control:
        os.sched_setaffinity(0, control)
    try:
        yield
    finally:
        os.sched_setaffinity(0, ALL_CPUS)


def load_hf(args):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype)).eval()
    model.generation_config.eos_token_id = None
    return model


@torch.inference_mode()
def run_hf_static(args, prompts) -> dict:
    model = load_hf(args)
    b = args.static_batch_size
    model.generate(torch.tensor(prompts[:1]), max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), b):
        ids = torch.tensor(prompts[i: i + b])  # equal lengths: no padding needed
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                             do_sample=False, pad_token_id=0)
        tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    elapsed = time.perf_counter() - start
    return {"label": "hf_static", "total_output_tokens": tokens, "duration": elapsed,
            "output_throughput": tokens / elapsed, "batch_size": b}


@torch.inference_mode()
def run_hf_continuous(args, prompts) -> dict:
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    model = load_hf(args)
    config = GenerationConfig(max_new_tokens=args.output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=config,
                               continuous_batching_config=ContinuousBatchingConfig(), progress_bar=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"label": "hf_continuous_batching", "total_output_tokens": tokens, "duration": elapsed,
            "output_throughput": tokens / elapsed}


def table(rows: list[dict]) -> str:
    head = f"{'system':<24}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}{'idle':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        idle = r.get("device_idle_fraction")
        lines.append(
            f"{r['label']:<24}{r['output_throughput']:>9.1f}"
            + "".join(f"{r[k]:>10.1f}" if k in r else f"{'-':>10}"
                      for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms"))
            + (f"{idle:>7.1%}" if idle is not None else f"{'-':>7}")
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--static-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Poisson arrivals for the stepahead runs (HF runs get every prompt at once)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0, help="prompt/output length spread")
    parser.add_argument("--skip-hf", action="store_true", help="only stepahead async vs sync")
    parser.add_argument("--serve-args", default="", help="extra flags for both stepahead runs")
    parser.add_argument("--out", type=Path, default=Path("results/compare.json"))
    args = parser.parse_args()
    if args.random_range_ratio and not args.skip_hf:
        parser.error("HF static batches need equal prompt lengths: add --skip-hf to --random-range-ratio")
    args.model_dir = resolve_model(args.model)
    args.vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = [run_stepahead(args, "stepahead_async"), run_stepahead(args, "stepahead_sync", "--no-async-scheduling")]
    if not args.skip_hf:
        prompts = workload(args)
        rows += [run_hf_continuous(args, prompts), run_hf_static(args, prompts)]
    by = {r["label"]: r["output_throughput"] for r in rows}
    ratios = {f"async/{k}": by["stepahead_async"] / v for k, v in by.items() if k != "stepahead_async"}
    print(table(rows))
    print(json.dumps(ratios, indent=2))
    args.out.write_text(json.dumps({"rows": [{k: v for k, v in r.items() if k != "config"} for r in rows],
                                    "ratios": ratios, "model": args.model, "num_prompts": args.num_prompts,
                                    "input_len": args.input_len, "output_len": args.output_len}, indent=2))


if __name__ == "__main__":
    main()
