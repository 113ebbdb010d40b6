"""N-gram speculative decoding: acceptance and output tokens/s with K = 2, 4, 8 vs without.

    PYTHONPATH=. .venv/bin/python benchmarks/speculative.py --model tiny \
        --out benchmarks/results/spec_tiny.json
    PYTHONPATH=. .venv/bin/python benchmarks/speculative.py --model sim \
        --out benchmarks/results/spec_sim.json
    PYTHONPATH=. .venv/bin/python benchmarks/speculative.py --model smollm2-135m \
        --out benchmarks/results/speculative_smollm2-135m.json

The real scheduler core and the real `ModelRunner` (or `--model sim`: the simulated H200
running Llama-3-8B, whose drafts are accepted with `--sim-acceptance-rate`) in one
process, driven through the scheduler's in-flight window exactly as the daemons do (async:
step t+1 is launched before step t's ids are read). Per workload, every K runs the same
greedy requests, interleaved over `--rounds` (drift on a shared machine hits all alike):

- `repetitive` (code edits): the prompt is S + G + S, where G is the model's own greedy
  continuation of a random S (`--doc-len` tokens): the text to reproduce is in the prompt,
  and a model that continues S the same way again reproduces it (random-weight models
  mostly do; `--model sim` accepts at its configured rate whatever the workload);
- `random`: random prompts of `--doc-len` tokens;
- `code` and `chat` (the default workloads of `--model smollm2-135m`, a trained model):
  real text, the Python code prefixes and the chat questions (rendered with the model's
  chat template) of benchmarks/compare.py, `--batch` of each, stopping at the model's EOS
  (`--ignore-eos` to run to `--max-tokens`). For this model K defaults to 0 and 4 with
  `--prompt-lookup-max 4`: the same drafter as serving with
  `--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'`.

Reports output tokens/s (committed tokens / wall seconds; the sim: / modelled device
seconds), steps, acceptance rate (accepted / proposed drafts) and mean accepted length
(tokens per drafting step), and checks that every K produced the same tokens as K = 0.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import time
from pathlib import Path

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.step_loop import StepLoop
from stepahead.plan import SamplingParams
from stepahead.speculative import SpeculativeConfig

BLOCK = 16


def build_runner(model: str, k: int, rate: float, num_blocks: int, lookup_max: int = 3):
    spec = SpeculativeConfig(k, 1, lookup_max) if k else None
    if model == "sim":
        from model_zoo.builtin_models import resolve_model
        from worker_service.sim.profiles import load_profile
        from worker_service.sim.runner import SimRunner

        return SimRunner(resolve_model("llama3-8b-sim"), load_profile("h200"), num_blocks=num_blocks,
                         block_size=BLOCK, speculative_config=spec, acceptance_rate=rate, seed=1)
    from model_zoo.builtin_models import resolve_model
    from worker_service.model_runner import ModelRunner

    return ModelRunner(resolve_model(model), block_size=BLOCK, num_blocks=num_blocks, speculative_config=spec,
                       max_num_seqs=64, max_num_batched_tokens=2048)


def real_workload(kind: str, model: str, n: int) -> list[list[int]]:

    from transformers import AutoTokenizer

    from model_zoo.builtin_models import resolve_model

    from benchmarks.compare import CHAT_QUESTIONS, CODE_PROMPTS

    model_dir = resolve_model(model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    if kind == "chat":
        texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
                 for q in CHAT_QUESTIONS[:n]]
    else:
        texts = CODE_PROMPTS[:n]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def workload(kind: str, runner, n: int, vocab: int, doc_len: int, seed: int, model: str = "") -> list[list[int]]:
    if kind in ("code", "chat"):
        return real_workload(kind, model, n)
    rng = random.Random(seed)
    if kind == "random":
        return [[rng.randrange(vocab) for _ in range(doc_len)] for _ in range(n)]
    seeds = [[rng.randrange(vocab) for _ in range(16)] for _ in range(n)]
    own = run_once(runner, 0, seeds, doc_len)["outputs"]  # the model's continuation G of each S
    return [s + own[f"r{i}"] + s for i, s in enumerate(seeds)]


def run_once(runner, k: int, prompts: list[list[int]], max_tokens: int, eos: tuple[int, ...] = ()) -> dict:
    config = SchedulerConfig(num_gpu_blocks=runner.num_blocks, max_model_len=runner.max_model_len, block_size=BLOCK,
                             max_num_batched_tokens=2048, max_num_seqs=64, num_speculative_tokens=k,
                             eos_token_ids=eos, enable_prefix_caching=False)
    sched = Scheduler(config)
    loop = StepLoop(sched)
    for i, p in enumerate(prompts):
        sched.add_request(Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                            ignore_eos=not eos)))
    outputs: dict[str, list[int]] = collections.defaultdict(list)
    pending = collections.deque()
    busy = 0.0
    start = time.perf_counter()
    while not loop.is_idle():
        while (plan := loop.plan_next()) is not None:
            pending.append(runner.launch(plan))
        result = pending.popleft().wait()
        busy += result.timing.device_busy_s
        _, events = loop.commit(result)
        for e in events:
            outputs[e.request_id] += e.new_token_ids
    wall = time.perf_counter() - start
    c = sched.counters()
    tokens = sum(len(v) for v in outputs.values())
    steps = c["num_steps"]
    return dict(seconds=busy if busy else wall, tokens=tokens, steps=steps, drafts=c["spec_num_draft_tokens"],
                accepted=c["spec_num_accepted_tokens"], outputs=dict(outputs))


def measure(args, kind: str) -> dict:
    runners = {k: build_runner(args.model, k, args.sim_acceptance_rate, args.num_blocks, args.prompt_lookup_max)
               for k in args.ks}
    vocab = min(r.vocab_size for r in runners.values())
    prompts = workload(kind, runners[min(runners)], args.batch, vocab, args.doc_len, seed=7, model=args.model)
    eos = () if args.ignore_eos or kind not in ("code", "chat") else args.eos
    runs = collections.defaultdict(list)
    for _ in range(args.rounds):
        for k, runner in runners.items():
            if hasattr(runner, "reset"):
                runner.reset()
            runs[k].append(run_once(runner, k, prompts, args.max_tokens, eos))
    base = runs[0][0]["outputs"] if 0 in runs else None
    rows = {}
    for k, rs in runs.items():
        same = base is None or all(r["outputs"] == base for r in rs)
        drafts, accepted = rs[0]["drafts"], rs[0]["accepted"]
        tok_s = statistics.median(r["tokens"] / r["seconds"] for r in rs)
        rows[k] = dict(output_tok_s=round(tok_s, 1), steps=rs[0]["steps"], draft_tokens=drafts,
                       accepted_tokens=accepted, acceptance_rate=round(accepted / drafts, 4) if drafts else None,
                       mean_tokens_per_step=round(rs[0]["tokens"] / rs[0]["steps"], 3),
                       same_tokens_as_k0=same)
    if 0 in rows:
        for row in rows.values():
            row["speedup_vs_k0"] = round(row["output_tok_s"] / rows[0]["output_tok_s"], 3)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny, 100m, smollm2-135m, a checkpoint directory, or sim")
    parser.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="K values (default 0,2,4,8; smollm2-135m: 0,4)")
    parser.add_argument("--prompt-lookup-max", type=int, default=None, help="default 3 (smollm2-135m: 4)")
    parser.add_argument("--workloads", default=None,
                        help="comma-separated: repetitive, random, code, chat (default repetitive,random; "
                             "smollm2-135m: code,chat)")
    parser.add_argument("--ignore-eos", action="store_true", help="real-text workloads: run to --max-tokens")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--doc-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--sim-acceptance-rate", type=float, default=0.7)
    parser.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    real = args.model == "smollm2-135m"
    args.ks = args.ks or ([0, 4] if real else [0, 2, 4, 8])
    args.prompt_lookup_max = args.prompt_lookup_max or (4 if real else 3)
    kinds = (args.workloads or ("code,chat" if real else "repetitive,random")).split(",")
    args.eos = ()
    if args.model != "sim":
        from model_zoo.builtin_models import resolve_model

        eos = json.loads((resolve_model(args.model) / "config.json").read_text()).get("eos_token_id")
        args.eos = tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()
    if args.model != "sim":
        import torch

        torch.set_num_threads(args.num_threads)
    result = dict(model=args.model, batch=args.batch, max_tokens=args.max_tokens, doc_len=args.doc_len,
                  rounds=args.rounds, greedy=True, async_scheduling=True, prompt_lookup_min=1,
                  prompt_lookup_max=args.prompt_lookup_max, num_threads=args.num_threads,
                  stop_at_eos=bool(args.eos) and not args.ignore_eos)
    if args.model == "sim":
        result["sim_acceptance_rate"] = args.sim_acceptance_rate
    for kind in kinds:
        rows = measure(args, kind)
        result[kind] = {f"K={k}": row for k, row in rows.items()}
        for k, row in rows.items():
            print(f"{args.model:>5} {kind:>10} K={k}: {row}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
