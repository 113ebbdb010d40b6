"""Benchmark workloads: request traces (Azure CSV or JSONL) and their prompts. Pure Python.

Trace formats (first N requests after sorting by arrival; arrivals relative to the first):
- CSV with the public Azure LLM inference trace header `TIMESTAMP,ContextTokens,GeneratedTokens`
  (TIMESTAMP as `2023-11-16 18:15:46.6805900` or as seconds);
- JSONL, one object per line: `arrival_s`, `prompt_len`, `output_len`, optional `priority`
  (int, lower first) and `prefix_group` (string: requests of a group share a prompt prefix).
A request asking for 0 output tokens (the Azure traces have a few) asks for 1.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from stepahead.config import ConfigError

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
FIRST_TOKEN_ID = 5  # prompts avoid the built-in tokenizer's special ids 0-4


class TraceError(ConfigError):
    """A trace file that cannot be replayed; the message names the file, line and field (the
    command exits 2 with it, one line)."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # seconds after the first request (after --trace-speedup)
    prompt_len: int
    output_len: int
    priority: int = 0
    prefix_group: str | None = None


def load_trace(path: Path | str, num_prompts: int | None = None, speedup: float = 1.0) -> list[TraceRequest]:
    path = Path(path)
    if not (speedup > 0 and math.isfinite(speedup)):
        raise TraceError(f"--trace-speedup must be a positive number, got {speedup}")
    if not path.is_file():
        raise TraceError(f"trace file {path} does not exist")
    rows = _read_csv(path) if path.suffix.lower() == ".csv" else _read_jsonl(path)
    if not rows:
        raise TraceError(f"trace file {path} holds no requests")
    rows.sort(key=lambda r: r.arrival_s)
    rows = rows[:num_prompts] if num_prompts else rows
    t0 = rows[0].arrival_s
    return [TraceRequest((r.arrival_s - t0) / speedup, r.prompt_len, r.output_len, r.priority, r.prefix_group)
            for r in rows]


def _read_csv(path: Path) -> list[TraceRequest]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}: CSV header lacks {missing} (Azure trace columns: {','.join(AZURE_COLUMNS)})")
        return [TraceRequest(_timestamp(row["TIMESTAMP"], path, n),
                             _length(row["ContextTokens"], "ContextTokens", path, n, 1),
                             max(1, _length(row["GeneratedTokens"], "GeneratedTokens", path, n, 0)))
                for n, row in enumerate(reader, start=2)]


def _read_jsonl(path: Path) -> list[TraceRequest]:
    out = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{n}: not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise TraceError(f"{path}:{n}: expected a JSON object")
        for key in ("arrival_s", "prompt_len", "output_len"):
            if key not in raw:
                raise TraceError(f"{path}:{n}: missing {key}")
        arrival = raw["arrival_s"]
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival):
            raise TraceError(f"{path}:{n}: arrival_s must be a finite number, got {arrival!r}")
        group = raw.get("prefix_group")
        out.append(TraceRequest(float(arrival), _length(raw["prompt_len"], "prompt_len", path, n, 1),
                                max(1, _length(raw["output_len"], "output_len", path, n, 0)),
                                _int(raw.get("priority", 0), "priority", path, n),
                                None if group is None else str(group)))
    return out


def _int(value, name: str, path: Path, line: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TraceError(f"{path}:{line}: {name} must be an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise TraceError(f"{path}:{line}: {name} must be an integer, got {value!r}") from None


def _length(value, name: str, path: Path, line: int, lowest: int) -> int:
    n = _int(value, name, path, line)
    if n < lowest:
        raise TraceError(f"{path}:{line}: {name} must be >= {lowest}, got {n}")
    return n


def _timestamp(raw: str, path: Path, line: int) -> float:
    raw = raw.strip()
    try:
        return float(raw)
    except ValueError:
        pass
    head, _, frac = raw.partition(".")
    try:
        stamp = dt.datetime.fromisoformat(head)
    except ValueError:
        raise TraceError(f"{path}:{line}: TIMESTAMP {raw!r} is neither seconds nor 'YYYY-MM-DD HH:MM:SS[.f]'") from None
    if frac and not frac.isdigit():
        raise TraceError(f"{path}:{line}: TIMESTAMP {raw!r} has a bad fraction")
    seconds = stamp.replace(tzinfo=stamp.tzinfo or dt.timezone.utc).timestamp()
    return seconds + (int(frac) / 10 ** len(frac) if frac else 0.0)


def trace_prompts(trace: list[TraceRequest], vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids of each request's length. A prefix group shares its first
    (shortest prompt in the group - 1) tokens, so every member still has one token of its own."""
    rng = random.Random(seed)
    shortest: dict[str, int] = {}
    for r in trace:
        if r.prefix_group is not None:
            shortest[r.prefix_group] = min(shortest.get(r.prefix_group, r.prompt_len), r.prompt_len)
    prefixes = {g: [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n - 1)] for g, n in sorted(shortest.items())}
    prompts = []
    for r in trace:
        head = prefixes.get(r.prefix_group, []) if r.prefix_group is not None else []
        prompts.append(head + [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(r.prompt_len - len(head))])
    return prompts


def long_prompt_trace(n: int, rate: float, seed: int = 0, max_model_len: int = 8192, prompt_median: int = 2048,
                      prompt_sigma: float = 0.35, output_median: int = 24, output_sigma: float = 0.7,
                      max_output: int = 256) -> list[TraceRequest]:
    """`n` requests shaped like the Azure LLM inference trace's code service: long prompts
    (log-normal around `prompt_median` tokens) and short outputs (log-normal around
    `output_median`, at most `max_output`), prompt + output within `max_model_len`; Poisson
    arrivals at `rate` per second (`inf`: all at 0). The lengths depend on `seed` only and the
    arrivals are the same draws divided by `rate`, so traces of one seed at two rates differ
    only in their time scale."""
    if n < 1 or not rate > 0:
        raise ValueError(f"long_prompt_trace needs n >= 1 and rate > 0, got {n}, {rate}")
    lengths, gaps = random.Random(seed), random.Random(seed + 1)
    out, t = [], 0.0
    for _ in range(n):
        output = min(max_output, max(1, round(lengths.lognormvariate(math.log(output_median), output_sigma))))
        prompt = max(1, round(lengths.lognormvariate(math.log(prompt_median), prompt_sigma)))
        out.append(TraceRequest(t, min(prompt, max_model_len - output), output))
        t += gaps.expovariate(1.0) / rate
    return out


def write_jsonl_trace(path: Path | str, trace: list[TraceRequest]) -> Path:
    """`trace` as a JSONL trace file (`load_trace` reads it back)."""
    path = Path(path)
    rows = [{"arrival_s": r.arrival_s, "prompt_len": r.prompt_len, "output_len": r.output_len,
             **({"priority": r.priority} if r.priority else {}),
             **({"prefix_group": r.prefix_group} if r.prefix_group is not None else {})} for r in trace]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
