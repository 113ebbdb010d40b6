"""Issue 36's scenario: structured outputs with n-gram speculation on a busy machine.

    python benchmarks/structured_contention.py [--requests 12] [--no-burners] [--no-speculation]
                                               [--out benchmarks/results/structured_contention.json]

Starts `stepahead serve --model tiny --speculative-config '{"method": "ngram",
"num_speculative_tokens": 4, "prompt_lookup_max": 4}'` (its daemons' logs captured), keeps
every CPU busy with one busy-loop process per core, and sends `--requests` chat completions
one after another through the official `openai` client with `response_format` = a small JSON
schema (an integer, an enum, an array of enums), max_tokens 200, seed=i: first at
temperature 0.8, then the same number at temperature 0. Counts, in the daemons' logs,
`step_failed`, `worker_lost`, `engine_crashed`, `request_failed` and tracebacks, and on the
client side errors and replies that are not valid against the schema. Prints the counts and
writes them to `--out`.

Run against older code with `PYTHONPATH=<checkout> python <this file>`: the daemons are
started with the same interpreter and PYTHONPATH, and the imported package's path is
recorded (`stepahead_path`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
SCHEMA = {
    "type": "object",
    "properties": {
        "count": {"type": "integer"},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
    },
    "required": ["count", "kind", "tags"],
    "additionalProperties": False,
}
EVENTS = ("step_failed", "worker_lost", "engine_crashed", "request_failed")
READY = re.compile(r"stepahead ready: gateway at (\S+) \(scheduler at (\S+)\)(?: http at (\S+))?")


def valid(obj) -> bool:
    """`obj` against SCHEMA (by hand: no jsonschema dependency)."""
    return (isinstance(obj, dict) and set(obj) == {"count", "kind", "tags"}
            and isinstance(obj["count"], int) and not isinstance(obj["count"], bool)
            and obj["kind"] in ("cat", "dog", "bird")
            and isinstance(obj["tags"], list) and all(t in ("red", "green", "blue") for t in obj["tags"]))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(flags: list[str]) -> tuple[subprocess.Popen, str, list[str], threading.Thread]:
    http_port = free_port()
    env = dict(os.environ, STEPAHEAD_LOG_LEVEL="warning")
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--model", "tiny", "--port", "0",
                             "--http-port", str(http_port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # every daemon's log
    reader.start()
    ready = threading.Event()
    found: list[str] = []

    def read_stdout() -> None:
        for line in proc.stdout:
            m = READY.search(line)
            if m and not found:
                found.append(m.group(3) or f"http://127.0.0.1:{http_port}")
                ready.set()
        ready.set()

    threading.Thread(target=read_stdout, daemon=True).start()
    if not ready.wait(600) or not found:
        proc.kill()
        raise SystemExit(f"serve did not become ready (exit code {proc.poll()}):\n{''.join(lines[-40:])}")
    return proc, found[0], lines, reader


def burners() -> list[subprocess.Popen]:
    code = "import time\nend = time.monotonic() + 1800\nwhile time.monotonic() < end: pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(os.cpu_count() or 1)]


def count_events(lines: list[str]) -> dict[str, int]:
    counts = collections.Counter({e: 0 for e in EVENTS})
    counts["traceback"] = 0
    counts["other_warning_or_above"] = 0
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict):
            event = rec.get("event")
            if event in EVENTS:
                counts[event] += 1
            elif rec.get("level") in ("warning", "error", "critical"):
                counts["other_warning_or_above"] += 1
            if "Traceback" in json.dumps(rec):
                counts["traceback"] += 1
        elif "Traceback" in line:
            counts["traceback"] += 1
    return dict(counts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=12, help="requests per temperature")
    ap.add_argument("--no-burners", action="store_true")
    ap.add_argument("--no-speculation", action="store_true")
    ap.add_argument("--label", default="", help="recorded with the result (e.g. 'before', 'after')")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "structured_contention.json"))
    args = ap.parse_args()

    import openai

    import stepahead

    flags = [] if args.no_speculation else ["--speculative-config", SPEC]
    proc, http_url, lines, reader = start_serve(flags)
    busy = [] if args.no_burners else burners()
    client_errors: list[str] = []
    invalid: list[str] = []
    t0 = time.monotonic()
    try:
        with openai.OpenAI(base_url=http_url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
            for temperature in (0.8, 0.0):
                for i in range(args.requests):
                    try:
                        r = client.chat.completions.create(
                            model="tiny", messages=[{"role": "user", "content": f"describe pet {i}"}],
                            response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}},
                            max_tokens=200, seed=i, temperature=temperature)
                    except openai.OpenAIError as exc:
                        client_errors.append(f"t={temperature} i={i}: {type(exc).__name__}: {exc}"[:300])
                        continue
                    text = r.choices[0].message.content or ""
                    try:
                        ok = valid(json.loads(text))
                    except ValueError:
                        ok = False
                    # a reply cut by max_tokens is not a complete object; counted apart
                    if not ok and r.choices[0].finish_reason != "length":
                        invalid.append(f"t={temperature} i={i}: {text[:120]!r}")
    finally:
        elapsed = time.monotonic() - t0
        for p in busy:
            p.kill()
            p.wait()
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    reader.join(30)  # the daemons have exited: their last log lines
    result = {
        "label": args.label,
        "stepahead_path": str(Path(stepahead.__file__).resolve().parent),
        "speculation": not args.no_speculation,
        "burners": len(busy),
        "cpu_count": os.cpu_count(),
        "requests": 2 * args.requests,
        "temperatures": [0.8, 0.0],
        "seconds": round(elapsed, 1),
        "log_counts": count_events(lines),
        "client_errors": len(client_errors),
        "client_error_samples": client_errors[:5],
        "invalid_replies": len(invalid),
        "invalid_samples": invalid[:5],
        "serve_exit_code": proc.returncode,
    }
    print(json.dumps(result, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    if out.exists():
        try:
            runs = json.loads(out.read_text()).get("runs", [])
        except ValueError:
            runs = []
    runs = [r for r in runs if r.get("label") != args.label or not args.label] + [result]
    out.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
