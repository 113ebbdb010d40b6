"""stepahead async vs sync vs Hugging Face (vs llama.cpp), same model and workload, one invocation.

    .venv/bin/python benchmarks/compare.py --model tiny --out benchmarks/results/compare_tiny.json
    .venv/bin/python benchmarks/compare.py --model smollm2-135m --concurrency 16,64 \
        --out benchmarks/results/compare_smollm2-135m.json

Runs, one after the other on this machine: `stepahead serve` (async scheduling) and
`stepahead serve --no-async-scheduling`, each measured by `stepahead bench`; Hugging Face
`generate_batch` (continuous batching, `ContinuousBatchingConfig`); and Hugging Face
static `generate` in batches. Every run decodes greedily with EOS ignored, so every system
produces the same number of tokens. Prints one table and writes JSON.

`--dataset real` (the default for `smollm2-135m`) sends real text instead of random ids:
chat questions rendered with the model's chat template and Python code prefixes, cycled
to `--num-prompts`. `--concurrency 16,64` measures every system at each cap on requests in
flight (stepahead and llama.cpp: the client's cap; HF static: the batch size; HF continuous
batching: `max_requests_per_batch`); without it every request is sent at once, as before.
TTFT and TPOT count from the moment a request is admitted (its slot under the cap, its HF
batch, its HF continuous-batching admission), so queueing behind the cap is not in them.

With `--model smollm2-135m`, llama.cpp's server (`llama-cpp-python[server]`, an optional
peer, used only when importable; `--skip-llamacpp` to leave it out) serves the same GGUF
file the built-in model is converted from, and an F16 copy of it (`--llamacpp-f16`, made
once with llama.cpp's own quantize tool, requantizing allowed). Its requests are
OpenAI-compatible streaming completions of the same prompt text, greedy, with the
end-of-generation tokens biased away so that every request gives its full output length.

llama.cpp's own server (`llama-server`: parallel slots, continuous batching) is the stronger
peer. `--llama-server PATH` (default: `$LLAMA_SERVER`, else `llama-server` on the PATH) runs it
on an F32 copy of the same GGUF (made once with the `llama-quantize` beside it), with one slot
per request in flight, and `--llama-server-q4` on the Q4_1 file too. llama.cpp is never a
dependency: build its server from the source that `llama-cpp-python`'s sdist vendors
(docs/benchmarks.md says how).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch

from cli import bench
from model_zoo.builtin_models import resolve_model
from testing.launcher import ServeProcess

ALL_CPUS = os.sched_getaffinity(0)


CHAT_QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash table is to a beginner.",
    "Give me three tips for writing clear emails.",
    "Why is the sky blue?",
    "Write a short poem about the sea.",
    "What are the main differences between Python and JavaScript?",
    "How do vaccines work?",
    "Summarize the plot of Romeo and Juliet.",
    "What is photosynthesis?",
    "Suggest a healthy breakfast and explain why it is healthy.",
    "How does a bicycle stay upright?",
    "What is the difference between weather and climate?",
    "Describe how to make a cup of tea.",
    "What causes earthquakes?",
    "Explain recursion with an example.",
    "What should I pack for a weekend hiking trip?",
    "How do airplanes fly?",
    "What is machine learning?",
    "Give me a recipe for pancakes.",
    "Why do we have seasons?",
    "What is the tallest mountain in the world and how tall is it?",
    "Explain the rules of chess briefly.",
    "How can I improve my sleep?",
    "What is an API?",
    "Tell me a fun fact about octopuses.",
    "What is the water cycle?",
    "How do I stay focused while studying?",
    "What is the difference between a virus and a bacterium?",
    "Explain what a database index is.",
    "Write a haiku about autumn.",
    "What is inflation in economics?",
    "How does the internet work?",
]

CODE_PROMPTS = [
    "def fibonacci(n):",
    "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
    "def quicksort(items):",
    "def binary_search(arr, target):\n",
    "class Stack:\n    def __init__(self):\n",
    "def reverse_string(s):",
    "def factorial(n):\n    if n == 0:\n",
    "import json\n\ndef load_config(path):\n",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "def count_words(text):",
    "class LinkedList:\n    def __init__(self):\n        self.head = None\n\n    def append(self, value):\n",
    "def gcd(a, b):",
    "def flatten(nested):\n    \"\"\"Flatten a list of lists.\"\"\"\n",
    "def is_palindrome(s):",
    "import os\n\ndef list_python_files(root):\n",
    "def matrix_multiply(a, b):",
    "def bubble_sort(arr):\n    n = len(arr)\n",
    "def celsius_to_fahrenheit(c):",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n",
    "def read_csv(path):\n    rows = []\n",
    "def longest_common_prefix(strs):",
    "def two_sum(nums, target):\n",
    "def power_set(s):",
    "def dfs(graph, start):\n    visited = set()\n",
    "def word_frequencies(text):\n    \"\"\"Return a dict mapping each word to its count.\"\"\"\n",
    "def transpose(matrix):",
    "import re\n\ndef extract_emails(text):\n",
    "def running_average(values):",
    "class Queue:\n    def __init__(self):\n",
    "def chunks(lst, n):\n    \"\"\"Yield successive n-sized chunks from lst.\"\"\"\n",
    "def levenshtein(a, b):",
    "def parse_date(s):\n    from datetime import datetime\n",
]


def real_texts(model_dir: Path, n: int) -> list[str]:
    """Chat questions rendered with the model's chat template, alternating with code prefixes."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in CHAT_QUESTIONS]
    mixed = [t for pair in zip(chats, CODE_PROMPTS) for t in pair]
    return [mixed[i % len(mixed)] for i in range(n)]


def real_workload(args) -> tuple[list[str], list[list[int]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    texts = real_texts(args.model_dir, args.num_prompts)
    if args.real_prompt_len:
        texts = lengthen(tok, texts, args.real_prompt_len)
    # the chat template already starts with its own special tokens; the model adds no BOS
    return texts, [tok(t, add_special_tokens=False).input_ids for t in texts]


def lengthen(tok, texts: list[str], length: int) -> list[str]:
    """Each text followed by the next ones until it has `length` tokens, cut there and decoded:
    real text of (within a token or two of re-tokenizing) `length` tokens, the same string for
    every system, so the peers that take text (llama.cpp) read what stepahead and HF read."""
    ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
    out = []
    for i in range(len(texts)):
        run: list[int] = []
        j = i
        while len(run) < length:
            run += ids[j % len(ids)]
            j += 1
        out.append(tok.decode(run[:length]))
    return out


def workload(args) -> list[list[int]]:
    """Exactly the prompts `stepahead bench` sends (or the real-text prompts)."""
    if args.dataset == "real":
        return args.real_prompts
    return [w.prompt for w in bench.make_workload(bench_args(args, "hf", "", ""), args.vocab)]


def bench_args(args, label: str, target: str, scheduler: str, token: str = "",
               concurrency: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(
        target=target, scheduler=scheduler, cluster_token=token, num_prompts=args.num_prompts, random_input_len=args.input_len,
        random_output_len=args.output_len, random_range_ratio=args.random_range_ratio,
        request_rate=args.request_rate,
        max_concurrency=concurrency, ignore_eos=True, seed=args.seed, label=label, disable_tqdm=False,
        dataset_name="random", dataset_path=None, trace_speedup=1.0,
        result_filename=args.out.parent / f"{args.out.stem}_{label}.json",
    )


def run_stepahead(args, label: str, *flags: str) -> dict:
    extra = args.serve_args.split()
    if not args.concurrency:
        with ServeProcess(args.model_dir, "--dtype", args.dtype, "--max-num-seqs", str(args.num_prompts), *extra,
                          *flags) as s:
            with client_off_device_cores():
                return bench.bench(bench_args(args, label, s.gateway_addr, s.scheduler_addr, s.cluster_token))
    rows = []
    with ServeProcess(args.model_dir, "--dtype", args.dtype, "--max-num-seqs", str(max(args.concurrency)), *extra,
                      *flags, capture_stderr=True) as s:
        for c in args.concurrency:
            with client_off_device_cores():
                rows.append(bench_items(args, s, f"{label}@{c}", c))
        problems = s.log_problems()
    for r in rows:
        r["daemon_problems"] = problems[:10]
    return rows


def variants(args) -> list[tuple[str, list[str]]]:
    """`--variant LABEL=FLAGS` as (label, flags)."""
    out = []
    for v in args.variant:
        label, sep, flags = v.partition("=")
        if not sep or not label:
            raise SystemExit(f"--variant {v!r}: expected LABEL=FLAGS")
        out.append((label, flags.split()))
    return out


def bench_items(args, s, label: str, concurrency: int) -> dict:
    """`stepahead bench` on the given prompts (bench.bench draws random ids itself)."""
    import asyncio

    from stepahead import security
    from stepahead.v1 import generation_pb2_grpc

    items = [bench.WorkItem(p, args.output_len) for p in workload(args)]
    a = bench_args(args, label, s.gateway_addr, s.scheduler_addr, s.cluster_token, concurrency)
    with security.channel(s.gateway_addr, api_key=os.environ.get("STEPAHEAD_API_KEY")) as channel:
        bench.one_request(generation_pb2_grpc.GenerationStub(channel), bench.WorkItem(items[0].prompt, 2), True)
    counters = bench.DeviceCounters(s.scheduler_addr, s.cluster_token)
    try:
        results, elapsed, window = asyncio.run(bench.run_workload_async(
            s.gateway_addr, os.environ.get("STEPAHEAD_API_KEY"), items, a, counters.snapshot))
    finally:
        counters.close()
    row = {"label": label, "concurrency": concurrency, **bench.summarize(results, elapsed),
           **bench.device_report(s.scheduler_addr, window, s.cluster_token)}
    return row


@contextlib.contextmanager
def client_off_device_cores():
    """The benchmark client runs on the control-plane core, as a client on another host
    would not take the device's cores (set only after the server started: children
    inherit affinity)."""
    from cli.serve import cpu_split

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


def latency_row(label: str, concurrency: int, tokens: int, elapsed: float, ttfts_s: list[float],
                tpots_s: list[float], **extra) -> dict:
    return {"label": label, "concurrency": concurrency, "total_output_tokens": tokens, "duration": elapsed,
            "output_throughput": tokens / elapsed, **bench.latency_stats("ttft", [t * 1e3 for t in ttfts_s]),
            **bench.latency_stats("tpot", [t * 1e3 for t in tpots_s]), **extra}


class StepClock:
    """A logits processor that only reads the clock: `generate` calls it once per new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


@torch.inference_mode()
def run_hf_static_padded(args, prompts, b: int) -> dict:
    """Static batches of `b` prompts of any lengths, left-padded; each request's TTFT counts
    from its batch's start, its TPOT over the rest of the batch's steps."""
    from transformers import LogitsProcessorList

    model = load_hf(args)
    pad = 0
    model.generate(torch.tensor(prompts[:1]), max_new_tokens=2, do_sample=False, pad_token_id=pad)  # warm-up
    start, tokens, ttfts, tpots = time.perf_counter(), 0, [], []
    for i in range(0, len(prompts), b):
        batch = prompts[i: i + b]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        clock = StepClock()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=args.output_len, do_sample=False,
                             pad_token_id=pad, logits_processor=LogitsProcessorList([clock]))
        n = out.shape[1] - ids.shape[1]
        tokens += n * ids.shape[0]
        ttfts += [clock.times[0] - t0] * len(batch)
        tpots += [(clock.times[-1] - clock.times[0]) / max(1, n - 1)] * len(batch)
    elapsed = time.perf_counter() - start
    return latency_row(f"hf_static@{b}", b, tokens, elapsed, ttfts, tpots, batch_size=b)


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


@torch.inference_mode()
def run_hf_continuous_capped(args, prompts, c: int) -> dict:
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    model = load_hf(args)
    config = GenerationConfig(max_new_tokens=args.output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    try:
        out = model.generate_batch(inputs=prompts, generation_config=config, record_timestamps=True,
                                   continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=c),
                                   progress_bar=False)
    except Exception as exc:  # reported in the table, never hidden
        return {"label": f"hf_continuous_batching@{c}", "concurrency": c, "output_throughput": float("nan"),
                "error": repr(exc)[:300]}
    elapsed = time.perf_counter() - start
    outs = list(out.values())
    tokens = sum(len(o.generated_tokens) for o in outs)
    ttfts = [o.timestamps[0] - o.lifespan[0] for o in outs if o.timestamps]
    tpots = [(o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1) for o in outs
             if o.timestamps and len(o.timestamps) > 1]
    return latency_row(f"hf_continuous_batching@{c}", c, tokens, elapsed, ttfts, tpots,
                       errors=sorted({o.error for o in outs if o.error})[:5])


# ---- llama.cpp (llama-cpp-python's OpenAI-compatible server), an optional peer ----

def llamacpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
        import llama_cpp.server  # noqa: F401
    except Exception:
        return False
    return True


def llamacpp_f16(gguf: Path, cache: Path) -> Path:
    """An F16 copy of `gguf`, made once by llama.cpp's quantize (dequantizing the Q4_1 blocks)."""
    import llama_cpp

    out = cache / (gguf.stem.replace("Q4_1", "F16") + ".gguf")
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_F16
    params.allow_requantize = True
    params.nthread = 2
    tmp = out.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(gguf).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize to F16 failed (rc {rc})")
    tmp.rename(out)
    return out


@contextlib.contextmanager
def llamacpp_server(gguf: Path, threads: int, n_ctx: int):
    """llama-cpp-python's server runs one completion at a time (a lock around its one
    context): requests beyond the first wait, which is what its numbers measure."""
    import sys

    from cli.serve import free_port

    port = free_port()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"llamacpp_{port}.log", "w")
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
           "--n_batch", "512", "--verbose", "False",
           # its default cuts a streaming request short as soon as another one waits
           "--interrupt_requests", "False"]
    with _server_process("llama_cpp.server", cmd, log, f"http://127.0.0.1:{port}", "/v1/models") as url:
        yield url, cmd


@contextlib.contextmanager
def _server_process(name: str, cmd: list[str], log, url: str, ready_path: str):
    """Server `name` started as `cmd`, its output to `log`, until `url + ready_path` answers;
    stopped on exit."""
    import subprocess
    import urllib.request

    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}: see {log.name}")
            try:
                urllib.request.urlopen(url + ready_path, timeout=1).read()
                break
            except Exception:
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except Exception:
            proc.kill()
        log.close()


def llama_server_binary(args) -> Path | None:
    import shutil

    found = args.llama_server or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    return Path(found) if found else None


def llamacpp_f32(gguf: Path, cache: Path, server: Path) -> Path:
    """An F32 copy of `gguf` (the Q4_1 blocks dequantized), made once with the `llama-quantize`
    next to `server`: the same weights the built-in model is converted to."""
    import subprocess

    out = cache / (gguf.stem.replace("Q4_1", "F32") + ".gguf")
    if out.exists():
        return out
    quantize = server.with_name("llama-quantize")
    if not quantize.exists():
        raise RuntimeError(f"{quantize} not found (build the llama-quantize target beside llama-server)")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    subprocess.run([str(quantize), "--allow-requantize", str(gguf), str(tmp), "F32", "2"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp.rename(out)
    return out


@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, threads: int, n_ctx: int, slots: int):
    """llama.cpp's `llama-server` with `slots` parallel sequences (continuous batching, its
    default), `n_ctx` tokens of context each."""
    from cli.serve import free_port

    port = free_port()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"llama_server_{port}.log", "w")
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-np", str(slots), "-c", str(n_ctx * slots), "-b", "2048", "-ub", "512",
           "--no-webui"]
    with _server_process("llama-server", cmd, log, f"http://127.0.0.1:{port}", "/health") as url:
        yield url, cmd


def _llamacpp_one(url: str, text: str, max_tokens: int, bias: dict, extra: dict | None = None) -> bench.RequestMetrics:
    import urllib.request

    m = bench.RequestMetrics(prompt_len=0)
    body = json.dumps({"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                       "logit_bias": bias, "stop": [], **(extra or {})}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    m.start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=3600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage") and not chunk.get("choices"):
                    continue  # llama-server's usage chunk, after the last token
                choices = chunk.get("choices") or [{}]
                if choices[0].get("finish_reason") is not None and not choices[0].get("text"):
                    continue  # the closing chunk carries no token
                now = time.perf_counter()
                if not m.first_token:
                    m.first_token = now
                m.token_times.append(now)
                m.output_len += 1  # one streamed chunk per generated token
    except Exception as exc:
        m.error = repr(exc)[:200]
    m.end = time.perf_counter()
    return m


def run_llama_clients(args, label: str, server, gguf: Path, texts: list[str], c: int, extra: dict | None = None) -> dict:
    """`c` client threads, each streaming one request at a time (the client's cap), against
    `server` (a context manager giving its URL and command line) serving `gguf`; `extra`: more
    request fields."""
    from concurrent.futures import ThreadPoolExecutor

    bias = {str(t): -100.0 for t in args.eog_ids}  # EOS ignored, as in every other run
    with server as (url, cmd), client_off_device_cores():
        _llamacpp_one(url, texts[0], 2, bias, extra)  # warm-up, not measured
        with ThreadPoolExecutor(c) as pool:
            t0 = time.perf_counter()
            results = list(pool.map(lambda t: _llamacpp_one(url, t, args.output_len, bias, extra), texts))
            elapsed = time.perf_counter() - t0
    s = bench.summarize(results, elapsed)
    short = sum(1 for r in results if not r.error and r.output_len < args.output_len)
    return {"label": f"{label}@{c}", "concurrency": c, "gguf": gguf.name, "server_command": " ".join(cmd[1:]),
            "requests_short_of_output_len": short, **s}


def table(rows: list[dict]) -> str:
    head = f"{'system':<34}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}{'idle':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        idle = r.get("device_idle_fraction")
        lines.append(
            f"{r['label']:<34}{r['output_throughput']:>9.1f}"
            + "".join(f"{r[k]:>10.1f}" if k in r else f"{'-':>10}"
                      for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms"))
            + (f"{idle:>7.1%}" if idle is not None else f"{'-':>7}")
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dataset", choices=["random", "real"], default=None,
                        help="random ids (default) or real chat + code text (default for smollm2-135m)")
    parser.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=None,
                        help="caps on requests in flight, e.g. 16,64 (default: all at once)")
    parser.add_argument("--skip-llamacpp", action="store_true", help="leave out llama.cpp even when installed")
    parser.add_argument("--llamacpp-f16", action=argparse.BooleanOptionalAction, default=True,
                        help="also serve an F16 copy of the GGUF with llama.cpp")
    parser.add_argument("--llama-server", type=Path, default=None,
                        help="llama.cpp's llama-server binary (default: $LLAMA_SERVER, else on the PATH)")
    parser.add_argument("--llama-server-q4", action="store_true",
                        help="also run llama-server on the Q4_1 file (default: the F32 copy only)")
    parser.add_argument("--llamacpp-threads", type=int, default=2)
    parser.add_argument("--llamacpp-ctx", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--real-prompt-len", type=int, default=0,
                        help="--dataset real: each prompt lengthened with the next ones to this many tokens "
                        "(0: the prompts as written)")
    parser.add_argument("--static-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Poisson arrivals for the stepahead runs (HF runs get every prompt at once)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0, help="prompt/output length spread")
    parser.add_argument("--skip-hf", action="store_true", help="only stepahead async vs sync")
    parser.add_argument("--serve-args", default="", help="extra flags for both stepahead runs")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=FLAGS",
                        help="one more stepahead (async) run, labelled stepahead_LABEL, with these serve flags "
                        "besides --serve-args, e.g. ref='--attention-backend torch' (repeatable)")
    parser.add_argument("--skip-sync", action="store_true", help="leave out the --no-async-scheduling run")
    parser.add_argument("--skip-hf-continuous", action="store_true", help="HF static generate only")
    parser.add_argument("--warmup-run", action="store_true",
                        help="one unrecorded stepahead run first (the first serve of an invocation has run "
                        "~3x slower than the same flags later in it on the shared development machine)")
    parser.add_argument("--out", type=Path, default=Path("results/compare.json"))
    args = parser.parse_args()
    if args.random_range_ratio and not args.skip_hf:
        parser.error("HF static batches need equal prompt lengths: add --skip-hf to --random-range-ratio")
    args.model_dir = resolve_model(args.model)
    args.vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.dataset is None:
        args.dataset = "real" if args.model == "smollm2-135m" else "random"
    if args.dataset == "real":
        args.real_texts, args.real_prompts = real_workload(args)
    if args.warmup_run:
        run_stepahead(args, "warmup")
    if not args.concurrency:
        rows = [run_stepahead(args, "stepahead_async")]
        if not args.skip_sync:
            rows.append(run_stepahead(args, "stepahead_sync", "--no-async-scheduling"))
        rows += [run_stepahead(args, f"stepahead_{label}", *flags) for label, flags in variants(args)]
        if not args.skip_hf:
            prompts = workload(args)
            if not args.skip_hf_continuous:
                rows.append(run_hf_continuous(args, prompts))
            rows.append(run_hf_static(args, prompts))
        by = {r["label"]: r["output_throughput"] for r in rows}
        ratios = {f"async/{k}": by["stepahead_async"] / v for k, v in by.items() if k != "stepahead_async"}
        print(table(rows))
        print(json.dumps(ratios, indent=2))
        args.out.write_text(json.dumps({"rows": [{k: v for k, v in r.items() if k != "config"} for r in rows],
                                        "ratios": ratios, "model": args.model, "num_prompts": args.num_prompts,
                                        "serve_args": args.serve_args, "variants": args.variant,
                                        "input_len": args.input_len, "output_len": args.output_len}, indent=2))
        return
    main_concurrency(args)


def main_concurrency(args) -> None:
    """Every system at every `--concurrency`, one table."""
    rows: list[dict] = []
    notes: dict[str, str] = {}

    def done(new):
        for r in new if isinstance(new, list) else [new]:
            rows.append(r)
            print(table([r]).splitlines()[-1], flush=True)
        partial = {"partial": True, "rows": [{k: v for k, v in r.items() if k != "config"} for r in rows]}
        args.out.write_text(json.dumps(partial, indent=2) + "\n")  # a cut run keeps what it measured

    done(run_stepahead(args, "stepahead_async"))
    if not args.skip_sync:
        done(run_stepahead(args, "stepahead_sync", "--no-async-scheduling"))
    for label, flags in variants(args):
        done(run_stepahead(args, f"stepahead_{label}", *flags))
    prompts = workload(args)
    if not args.skip_hf:
        for c in args.concurrency:
            if not args.skip_hf_continuous:
                done(run_hf_continuous_capped(args, prompts, c))
            done(run_hf_static_padded(args, prompts, c))
    run_llama_peers(args, done, notes)
    print()
    print(table(rows))
    for k, v in notes.items():
        print(f"{k}: {v}")
    by = {r["label"]: r["output_throughput"] for r in rows}
    ratios = {}
    for c in args.concurrency:
        base = by.get(f"stepahead_async@{c}")
        for k, v in by.items():
            if k.endswith(f"@{c}") and k != f"stepahead_async@{c}" and base and v == v and v:
                ratios[f"async/{k}"] = round(base / v, 3)
    print(json.dumps(ratios, indent=2))
    args.out.write_text(json.dumps({
        "model": args.model, "dataset": args.dataset, "num_prompts": args.num_prompts,
        "output_len": args.output_len, "concurrency": args.concurrency, "dtype": args.dtype,
        "serve_args": args.serve_args, "variants": args.variant, "ignore_eos": True, "greedy": True,
        "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "rows": [{k: v for k, v in r.items() if k != "config"} for r in rows],
        "ratios": ratios, "notes": notes}, indent=2) + "\n")


def run_llama_peers(args, done, notes: dict) -> None:
    """llama.cpp at every `--concurrency`: its own `llama-server` (F32 copy, and the Q4_1 file
    with `--llama-server-q4`) when a binary is found, llama-cpp-python's server when importable."""
    if args.skip_llamacpp:
        notes["llama.cpp"] = "left out (--skip-llamacpp)"
        return
    if args.model != "smollm2-135m":
        notes["llama.cpp"] = "only with --model smollm2-135m (needs the GGUF file)"
        return
    from model_zoo.builtin_models import PACKAGED_MODELS

    q = Path(PACKAGED_MODELS[args.model].path())
    args.eog_ids = sorted({0, 2})  # <|endoftext|>, <|im_end|>: the model's end-of-generation tokens
    texts = args.real_texts if args.dataset == "real" else None
    if texts is None:
        raise SystemExit("llama.cpp runs need --dataset real (they send text)")
    cache = args.model_dir.parent / "gguf"
    binary = llama_server_binary(args)
    if binary is None:
        notes["llama-server"] = "not measured: no llama-server binary (--llama-server, $LLAMA_SERVER or the PATH)"
    else:
        servers = []
        try:
            servers.append(("llama_server_f32", llamacpp_f32(q, cache, binary)))
        except Exception as exc:
            notes["llama-server F32"] = f"not measured: {exc!r}"[:300]
        if args.llama_server_q4:
            servers.append(("llama_server_q4_1", q))
        for label, path in servers:
            for c in args.concurrency:
                try:
                    server = llama_server(binary, path, args.llamacpp_threads, args.llamacpp_ctx, c)
                    # llama-server's own ignore_eos beside the bias
                    done(run_llama_clients(args, label, server, path, texts, c, {"ignore_eos": True}))
                except Exception as exc:
                    notes[f"{label}@{c}"] = f"failed: {exc!r}"[:300]
    if not llamacpp_available():
        notes["llama-cpp-python"] = "not measured: llama-cpp-python[server] is not importable in this environment"
        return
    ggufs = [("llamacpp_q4_1", q)]
    if args.llamacpp_f16:
        try:
            ggufs.append(("llamacpp_f16", llamacpp_f16(q, cache)))
        except Exception as exc:
            notes["llama.cpp F16"] = f"not measured: {exc!r}"
    for label, path in ggufs:
        for c in args.concurrency:
            try:
                server = llamacpp_server(path, args.llamacpp_threads, args.llamacpp_ctx)
                done(run_llama_clients(args, label, server, path, texts, c))
            except Exception as exc:
                notes[f"{label}@{c}"] = f"failed: {exc!r}"[:300]


if __name__ == "__main__":
    main()
