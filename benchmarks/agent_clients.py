"""Agent frameworks against `stepahead serve` (issue 32): LangChain's `bind_tools` and litellm's
function calling, N calls each, every parsed tool call checked against its schema.

The clients are not test extras (they pull large dependency trees), so they live in their own
virtual environment, never the server's; this script runs in it and starts the server with the
repository's Python:

    python3 -m venv /work/agents-venv && /work/agents-venv/bin/pip install langchain-openai litellm openai jsonschema
    /work/agents-venv/bin/python benchmarks/agent_clients.py --server-python .venv/bin/python \
        --model smollm2-135m --calls 10

It writes benchmarks/results/agent_clients.json: per client and tool_choice, the calls made, how
many returned a tool call, how many of those validate against the tool's schema, and the
seconds per call. `required` and a named function are enforced by the server (xgrammar), so
they must all validate; `auto` reads the model's own format (`--tool-call-parser hermes`), so a
model that answers in text instead returns no call there (counted, not an error).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import jsonschema

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": WEATHER_SCHEMA}}
ASK = "What is the weather in Paris right now, in celsius?"
READY = re.compile(r"stepahead ready: .* http at (http://\S+)")
CHOICES = {"named": {"type": "function", "function": {"name": "get_weather"}}, "required": "required",
           "auto": "auto"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(python: str, model: str, repo: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([python, "-m", "cli", "serve", "--model", model, "--port", "0",
                             "--http-port", str(free_port()),
                             "--tool-call-parser", "hermes"], cwd=repo, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(repo)))
    for line in proc.stdout:
        m = READY.search(line)
        if m:
            return proc, m.group(1)
    raise SystemExit(f"stepahead serve exited ({proc.wait()}) before it was ready")


def check(name: str, arguments) -> bool:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    if name != "get_weather":
        return False
    try:
        jsonschema.validate(args, WEATHER_SCHEMA)
    except jsonschema.ValidationError:
        return False
    return True


def langchain_call(base_url: str, model: str, choice) -> list[tuple[str, object]]:
    from langchain_openai import ChatOpenAI  # noqa: PLC0415 (the agents venv only)

    llm = ChatOpenAI(base_url=base_url + "/v1", api_key="unused", model=model, temperature=0, max_tokens=96)
    lc_choice = {"named": "get_weather", "required": "any", "auto": "auto"}[choice]
    message = llm.bind_tools([WEATHER], tool_choice=lc_choice).invoke(ASK)
    return [(c["name"], c["args"]) for c in message.tool_calls]


def litellm_call(base_url: str, model: str, choice) -> list[tuple[str, object]]:
    import litellm  # noqa: PLC0415

    out = litellm.completion(model=f"openai/{model}", api_base=base_url + "/v1", api_key="unused",
                             messages=[{"role": "user", "content": ASK}], tools=[WEATHER],
                             tool_choice=CHOICES[choice], temperature=0, max_tokens=96)
    calls = out.choices[0].message.tool_calls or []
    return [(c.function.name, c.function.arguments) for c in calls]


CLIENTS = {"langchain_bind_tools": langchain_call, "litellm_completion": litellm_call}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server-python", default=".venv/bin/python", help="the Python that has stepahead")
    parser.add_argument("--model", default="smollm2-135m", help="a built-in model or a checkpoint directory")
    parser.add_argument("--calls", type=int, default=10, help="calls per client and tool_choice")
    parser.add_argument("--out", default="benchmarks/results/agent_clients.json")
    args = parser.parse_args()
    repo = Path(__file__).resolve().parents[1]
    proc, base_url = start_server(args.server_python, args.model, repo)
    name = Path(args.model).name
    results = []
    try:
        for client, call in CLIENTS.items():
            for choice in CHOICES:
                made = valid = 0
                start = time.perf_counter()
                for _ in range(args.calls):
                    calls = call(base_url, name, choice)
                    made += bool(calls)
                    valid += bool(calls) and all(check(n, a) for n, a in calls)
                seconds = (time.perf_counter() - start) / args.calls
                row = {"client": client, "tool_choice": choice, "calls": args.calls, "returned_a_call": made,
                       "validated": valid, "seconds_per_call": round(seconds, 3)}
                print(json.dumps(row), flush=True)
                results.append(row)
    finally:
        proc.terminate()
        proc.wait(60)
    versions = {}
    for pkg in ("langchain-openai", "litellm", "openai"):
        from importlib import metadata  # noqa: PLC0415

        versions[pkg] = metadata.version(pkg)
    Path(args.out).write_text(json.dumps({"model": args.model, "server_flags": ["--tool-call-parser", "hermes"],
                                          "python": sys.version.split()[0], "client_versions": versions,
                                          "results": results}, indent=2) + "\n")
    enforced_ok = all(r["validated"] == r["calls"] for r in results if r["tool_choice"] != "auto")
    return 0 if enforced_ok else 1


if __name__ == "__main__":
    sys.exit(main())
