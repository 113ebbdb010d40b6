"""vLLM's scheduler in-process beside stepahead's core, on the same workload: CPU per step.

    PYTHONPATH=. .venv/bin/python benchmarks/vllm_scheduler.py --vllm-python /work/vllm-venv/bin/python \
        [--running 256 1024] [--steps 300] [--repeats 3] [--out benchmarks/results/vllm_scheduler.json]

The workload of `benchmarks/experiments/scheduler.py`: N running decode requests (128-token
prompts, no EOS) and 1,000 waiting ones that cannot be admitted (max_num_seqs = N), prefix
caching on, async scheduling (plans run ahead of results); each turn fills the in-flight
window and commits the oldest result, and the CPU time (`time.process_time`) of the
scheduler's own calls in it (schedule + update from the step's output) is the cost of a
step. A stand-in worker outside the timed region answers every plan with one token per
request that completes its prompt or decodes.

Each side runs in its own subprocess with its own interpreter: stepahead's core with this
one, vLLM's `AsyncScheduler` with `--vllm-python` (a separate venv where vLLM is installed
with `--no-deps` beside the CPU torch, its import-time dependencies pinned in
`benchmarks/vllm_scheduler_requirements.txt`; `VLLM_TARGET_DEVICE=cpu`). vLLM's config is built for
a small local Llama config.json (no weights, no tokenizer) and async scheduling is switched
back on after the config is built (vLLM turns it off for executors that do not support it).
The sides alternate, N by N, `--repeats` times, the order flipped every repeat; the result
is each side's median over the repeats of its per-run median, and their ratio. vLLM is
never a dependency of this project: without `--vllm-python` (or with one that cannot
import vLLM) the script says what failed and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

PROMPT_LEN, BLOCK_SIZE, NUM_WAITING, WINDOW = 128, 16, 1000, 2  # WINDOW: vLLM's async batch queue depth
ROOT = Path(__file__).resolve().parent.parent


def prompt(i: int) -> list[int]:
    """The experiment's prompts (`benchmarks/experiments/scheduler.py`)."""
    return [1 + (i * 7 + j) % 30000 for j in range(PROMPT_LEN)]


# --- stepahead's side (this project's interpreter) -------------------------------------------

def stepahead_side(num_running: int, steps: int) -> dict:
    from benchmarks.experiments.scheduler import measure

    row = measure(num_running, steps, async_scheduling=True)
    return {"median_ms": row["median_ms"], "p90_ms": row["p90_ms"], "mean_ms": row["mean_ms"]}


# --- vLLM's side (the --vllm-python interpreter; imports nothing of this project) ------------

LLAMA_CONFIG = {  # a small Llama: the scheduler reads the geometry, never weights
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000,
    "max_position_embeddings": PROMPT_LEN + 8192, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2,
}


def vllm_scheduler(num_running: int, model_dir: str):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    max_model_len = PROMPT_LEN + 8192
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=max_model_len, dtype="bfloat16")
    sched = SchedulerConfig(max_model_len=max_model_len, is_encoder_decoder=False, max_num_seqs=num_running,
                            max_num_batched_tokens=max(2048, num_running), async_scheduling=True)
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache)
    config.scheduler_config.async_scheduling = True  # VllmConfig turns it off without a GPU executor
    blocks_per_req = (PROMPT_LEN + 4096) // BLOCK_SIZE
    num_blocks = num_running * blocks_per_req + 64
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn", "layers.1.attn"], spec)])
    config.cache_config.num_gpu_blocks = num_blocks
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    scheduler = AsyncScheduler(vllm_config=config, kv_cache_config=kv,
                               structured_output_manager=StructuredOutputManager(config),
                               block_size=BLOCK_SIZE, log_stats=False)
    if not (scheduler.kv_cache_manager.enable_caching and scheduler.scheduler_config.async_scheduling):
        raise RuntimeError("vLLM's scheduler came up without prefix caching or async scheduling: "
                           f"caching={scheduler.kv_cache_manager.enable_caching}, "
                           f"async_scheduling={scheduler.scheduler_config.async_scheduling}")
    return scheduler, hash_fn


def vllm_side(num_running: int, steps: int) -> dict:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(LLAMA_CONFIG))
        scheduler, hash_fn = vllm_scheduler(num_running, model_dir)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    sampling = SamplingParams(max_tokens=4096, ignore_eos=True, temperature=0.0)

    def add(prefix: str, count: int) -> None:
        for i in range(count):
            scheduler.add_request(Request(f"{prefix}{i}", prompt(i), sampling, None, block_hasher=hasher))

    def answer(out) -> ModelRunnerOutput:
        """The stand-in worker: token 7 for each request whose prompt is now all computed."""
        ids = list(out.num_scheduled_tokens)
        sampled = [[7] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_prompt_tokens
                   else [] for r in ids]
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled)

    in_flight: deque = deque()

    def turn() -> float:
        cost = 0.0
        while len(in_flight) < WINDOW:
            t0 = time.process_time()
            out = scheduler.schedule()
            cost += time.process_time() - t0
            in_flight.append((out, answer(out)))
        out, result = in_flight.popleft()
        t0 = time.process_time()
        scheduler.update_from_output(out, result)
        return cost + time.process_time() - t0

    add("run", num_running)
    while len(scheduler.running) < num_running:
        turn()
    for _ in range(4):  # every running request is decoding now
        turn()
    add("wait", NUM_WAITING)
    times = [turn() for _ in range(steps)]
    if len(scheduler.running) != num_running or len(scheduler.waiting) != NUM_WAITING:
        raise RuntimeError(f"vLLM's scheduler left the workload: {len(scheduler.running)} running, "
                           f"{len(scheduler.waiting)} waiting (expected {num_running}, {NUM_WAITING})")
    return {"median_ms": statistics.median(times) * 1e3, "p90_ms": statistics.quantiles(times, n=10)[-1] * 1e3,
            "mean_ms": statistics.fmean(times) * 1e3}


SIDES = {"stepahead": stepahead_side, "vllm": vllm_side}


# --- the driver ------------------------------------------------------------------------------

def run_side(side: str, num_running: int, steps: int, vllm_python: str) -> dict:
    """One measurement in a fresh subprocess of the side's interpreter."""
    if side == "vllm":
        python = vllm_python
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env.setdefault("PYTHONHASHSEED", "0")  # vLLM's prefix hash seed: fixed, not per process
    else:
        python, env = sys.executable, dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [python, str(Path(__file__).resolve()), "--side", side, "--running", str(num_running),
           "--steps", str(steps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"the {side} side ({python}) failed at {num_running} running "
                         f"(exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_vllm(vllm_python: str | None) -> str:
    """The vLLM interpreter's vLLM version, or exit saying why there is none."""
    if not vllm_python:
        raise SystemExit("--vllm-python is required: the interpreter of a venv with vLLM installed "
                         "(the CPU torch, then pip install --no-deps -r benchmarks/vllm_scheduler_requirements.txt)")
    env = dict({k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, VLLM_TARGET_DEVICE="cpu")
    try:
        done = subprocess.run([vllm_python, "-c", "import vllm.v1.core.sched.async_scheduler, vllm; "
                               "print(vllm.__version__)"], env=env, capture_output=True, text=True, cwd="/")
    except OSError as exc:
        raise SystemExit(f"--vllm-python {vllm_python}: cannot run it: {exc}") from None
    if done.returncode != 0:
        raise SystemExit(f"--vllm-python {vllm_python}: vLLM's scheduler does not import:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="python of a venv with vLLM installed")
    parser.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=300, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)  # a subprocess's one run
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm_scheduler.json"))
    args = parser.parse_args()
    for name in ("steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if min(args.running) < 1:
        parser.error(f"--running must all be >= 1, got {args.running}")
    if args.side:
        print(json.dumps(SIDES[args.side](args.running[0], args.steps)))
        return
    version = check_vllm(args.vllm_python)
    sys.path.insert(0, str(ROOT))
    from benchmarks.machine import python_speed_ms

    runs = []
    for repeat in range(args.repeats):
        for n in args.running:
            order = ["stepahead", "vllm"] if repeat % 2 == 0 else ["vllm", "stepahead"]
            for side in order:
                speed = python_speed_ms()
                row = {"side": side, "running": n, "repeat": repeat, **run_side(side, n, args.steps, args.vllm_python),
                       "load_average": os.getloadavg()[0], "python_speed_ms": speed}
                runs.append(row)
                print(json.dumps(row), flush=True)
    summary = []
    for n in args.running:
        med = {s: statistics.median(r["median_ms"] for r in runs if r["side"] == s and r["running"] == n)
               for s in SIDES}
        summary.append({"running": n, "stepahead_ms": med["stepahead"], "vllm_ms": med["vllm"],
                        "vllm_over_stepahead": med["vllm"] / med["stepahead"]})
    print(f"{'running':>8} {'stepahead ms':>13} {'vLLM ms':>9} {'vLLM / stepahead':>17}")
    for s in summary:
        print(f"{s['running']:>8} {s['stepahead_ms']:>13.3f} {s['vllm_ms']:>9.3f} {s['vllm_over_stepahead']:>17.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "vllm_version": version, "scheduler": "vllm.v1.core.sched.async_scheduler.AsyncScheduler",
        "prompt_len": PROMPT_LEN, "block_size": BLOCK_SIZE, "waiting": NUM_WAITING, "prefix_caching": True,
        "steps": args.steps, "repeats": args.repeats, "cpus": os.cpu_count(), "summary": summary, "runs": runs,
    }, indent=2) + "\n")


if __name__ == "__main__":
    if "--side" in sys.argv and "vllm" in sys.argv:  # vLLM's interpreter: this directory's modules off the path
        sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    main()
