"""Operator mistakes fail at once: exit 2 within seconds, one stderr line naming the flag or
the checkpoint's file and field, no traceback, no retrying until a start-up timeout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.streams import wait_health

FAIL_WITHIN_S = 30.0  # generous on a loaded 2-core host; the failures are immediate

BAD_FLAGS = [
    ("serve", ["--block-size", "0"], "--block-size"),
    ("worker", ["--block-size", "0"], "--block-size"),
    ("serve", ["--max-num-seqs", "0"], "--max-num-seqs"),
    ("scheduler", ["--max-num-seqs", "0"], "--max-num-seqs"),
    ("worker", ["--max-num-seqs", "0"], "--max-num-seqs"),
    ("serve", ["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    ("scheduler", ["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    ("serve", ["--gpu-memory-utilization", "2"], "--gpu-memory-utilization"),
    ("worker", ["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    ("serve", ["--port", "70000"], "--port"),
    ("scheduler", ["--port", "-1"], "--port"),
    ("worker", ["--num-threads", "0"], "--num-threads"),
    ("worker", ["--enable-expert-parallel"], "--enable-expert-parallel"),  # needs --tensor-parallel-size >= 2
    ("worker", ["--cuda-graph-sizes", "8,x"], "--cuda-graph-sizes"),
    ("worker", ["--attention-backend", "flashinfer"], "--attention-backend flashinfer"),  # CUDA only
    ("worker", ["--device", "gpu0"], "--device gpu0"),
    ("worker", ["--max-cuda-graph-batch-size", "-1"], "--max-cuda-graph-batch-size"),
    ("serve", ["--startup-timeout-s", "0"], "--startup-timeout-s"),
    ("serve", ["--drain-timeout", "-1"], "--drain-timeout"),
    ("serve", ["--dtype", "float8"], "--dtype: 'float8' is not one of float32"),  # was the worker's traceback
    ("worker", ["--dtype", "float8"], "--dtype: 'float8' is not one of float32"),
    ("serve", ["--api-key", ""], "--api-key"),  # was a server without keys
    ("serve", ["--api-key", " , "], "--api-key"),
    ("serve", ["--served-model-name", ""], "--served-model-name"),  # clients had to send the cache path
    ("worker", ["--device", "sim", "--sim-profile", "nope"], "sim profile 'nope'"),  # was a traceback
]


def _edit(field: str, value):
    def edit(d: Path) -> None:
        c = json.loads((d / "config.json").read_text())
        if value is None:
            c.pop(field)
        else:
            c[field] = value
        (d / "config.json").write_text(json.dumps(c))
    return edit


def _heads_not_dividing(d: Path) -> None:
    c = json.loads((d / "config.json").read_text())
    c.pop("head_dim", None)
    c["num_attention_heads"] = 7
    (d / "config.json").write_text(json.dumps(c))


# name -> (how the tiny checkpoint is spoiled, what the error line names, commands that refuse it)
BAD_CHECKPOINTS = {
    "layers_1e6": (_edit("num_hidden_layers", 10**6), ["config.json", "num_hidden_layers"], ("serve", "worker")),
    "hidden_0": (_edit("hidden_size", 0), ["config.json", "hidden_size"], ("serve", "worker")),
    "vocab_negative": (_edit("vocab_size", -1), ["config.json", "vocab_size"], ("serve", "worker")),
    "heads_7": (_heads_not_dividing, ["config.json", "num_attention_heads"], ("serve", "worker")),
    "no_hidden_size": (_edit("hidden_size", None), ["config.json", "hidden_size"], ("serve", "worker")),
    "bad_json": (lambda d: (d / "config.json").write_text('{"model_type": "llama",'), ["config.json"],
                 ("serve", "worker")),
    "no_tokenizer": (lambda d: (d / "tokenizer.json").unlink(), ["tokenizer.json"], ("serve",)),
    # an architecture the worker does not build, as transformers saves it
    "falcon": (_edit("model_type", "falcon"), ["config.json", "model_type 'falcon' is not supported",
                                              "llama, mistral, qwen2, qwen3"], ("serve", "worker")),
    # a served family's value it does not implement, named
    "gemma2_gelu": (lambda d: (_edit("model_type", "gemma2")(d), _edit("hidden_activation", "gelu")(d)),
                    ["config.json", "unsupported hidden_activation 'gelu'"], ("serve",)),
    # a family with its own config.json names (GPT-2's n_embd, n_head, ...): the missing one named
    "gpt2_no_n_head": (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64})),
                       ["config.json", "field n_head is missing"], ("serve", "worker")),
    "gpt2_layer_idx_scaling": (
        lambda d: (d / "config.json").write_text(json.dumps(
            {"model_type": "gpt2", "vocab_size": 512, "n_embd": 64, "n_head": 4, "n_layer": 2,
             "scale_attn_by_inverse_layer_idx": True})),
        ["config.json", "unsupported scale_attn_by_inverse_layer_idx True"], ("serve",)),
}


def _run(command: str, *flags: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    extra = {"serve": ["--port", "0", "--http-port", "0"], "scheduler": ["--port", "0"],
             "worker": ["--scheduler", "127.0.0.1:1"]}[command]
    if "--port" in flags:
        extra = [a for a in extra if a not in ("--port", "0")] if command == "scheduler" else ["--http-port", "0"]
    proc = subprocess.run([sys.executable, "-m", "cli", command, *extra, *flags], capture_output=True,
                          text=True, timeout=FAIL_WITHIN_S, env=dict(os.environ, STEPAHEAD_LOG_LEVEL="info"))
    return proc, [line for line in proc.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("command, flags, named", BAD_FLAGS, ids=[f"{c}{' '.join(f)}" for c, f, _ in BAD_FLAGS])
def test_a_flag_out_of_range_exits_2_with_one_line(command, flags, named, tiny_model_dir) -> None:
    proc, lines = _run(command, "--model", str(tiny_model_dir), *flags) if command != "scheduler" \
        else _run(command, *flags)
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and named in lines[0], lines


@pytest.mark.parametrize("tp", [1, 2])
def test_a_kv_cache_budget_that_holds_no_block_exits_2_naming_the_flag(tp, tiny_model_dir) -> None:
    """Found while the worker loads, after the flags were parsed: an error line naming the flag
    and no traceback (it was one); with tensor parallelism the ranks stop instead of joining a
    new group and failing the same way forever (they did)."""
    proc, lines = _run("serve", "--model", str(tiny_model_dir), "--kv-cache-memory-bytes", "1",
                       "--tensor-parallel-size", str(tp))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "--kv-cache-memory-bytes" in lines[-1], lines[-3:]


def test_a_cuda_device_torch_cannot_see_exits_2_with_one_line(tiny_model_dir) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    proc, lines = _run("worker", "--model", str(tiny_model_dir), "--device", "cuda")
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "--device cuda" in lines[0] and "no CUDA device" in lines[0], lines


CASES = [(name, command) for name, (_, _, commands) in BAD_CHECKPOINTS.items() for command in commands]


@pytest.mark.parametrize("name, command", CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_a_bad_checkpoint_exits_2_with_one_line_naming_the_file_and_field(name, command, tiny_model_dir,
                                                                          tmp_path) -> None:
    spoil, named, _ = BAD_CHECKPOINTS[name]
    model = tmp_path / name
    shutil.copytree(tiny_model_dir, model)
    spoil(model)
    proc, lines = _run(command, "--model", str(model))
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, lines
    assert str(model) in lines[0] and all(n in lines[0] for n in named), lines
    assert "Traceback" not in proc.stderr


def test_a_refused_hello_is_fatal_and_serve_names_the_worker(tiny_model_dir) -> None:
    """The scheduler refuses the worker's hello as INVALID_ARGUMENT (no prompt of the model's
    length fits a step): the worker stops instead of re-attaching, serve names it."""
    proc, lines = _run("serve", "--model", str(tiny_model_dir), "--no-enable-chunked-prefill",
                       "--max-num-batched-tokens", "64", "--max-model-len", "128")
    assert proc.returncode == 2, proc.stderr
    assert lines[-1].startswith("stepahead: worker exited during start-up (code 2)"), lines[-1]
    assert "refused this worker" in lines[-1] and "max_num_batched_tokens" in lines[-1], lines[-1]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flag", ["--http-port", "--port"])
def test_a_taken_port_is_named_before_any_daemon_starts(flag, tiny_model_dir) -> None:
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = str(holder.getsockname()[1])
        flags = ["--http-port", port, "--port", "0"] if flag == "--http-port" else ["--port", port, "--http-port", "0"]
        proc = subprocess.run([sys.executable, "-m", "cli", "serve", str(tiny_model_dir), *flags],
                              capture_output=True, text=True, timeout=FAIL_WITHIN_S)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"{flag} {port}: cannot listen on 127.0.0.1:{port}" in lines[0], lines


def test_a_second_scheduler_on_a_running_ones_port_is_refused_not_sharing_it() -> None:
    """grpc listens with SO_REUSEPORT by default: a second daemon on a running one's port used to
    start and take half of the new connections (workers and gateways split between two
    schedulers, silently); the second one must refuse to start, naming the port."""
    from stepahead.ports import free_port

    port = str(free_port())
    first = subprocess.Popen([sys.executable, "-m", "cli", "scheduler", "--port", port, "--log-level", "warning"],
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_health(f"127.0.0.1:{port}", serving=False)  # it listens (no worker yet)
        second = subprocess.run([sys.executable, "-m", "cli", "scheduler", "--port", port],
                                capture_output=True, text=True, timeout=FAIL_WITHIN_S)
    finally:
        first.terminate()
        _, first_err = first.communicate(timeout=30)
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert f"--port {port}: cannot listen on" in lines[0], lines
    assert first.returncode == 0, first_err


def test_a_gguf_file_serve_cannot_convert_is_one_line(tmp_path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    proc, lines = _run("serve", str(bad))
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert str(bad) in lines[0] and "not a readable GGUF file" in lines[0], lines
