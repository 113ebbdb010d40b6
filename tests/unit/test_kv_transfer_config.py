"""The worker's disaggregation flags: a role with tensor parallelism, a KV transfer port it
cannot bind and an unknown sim link fail at once (exit 2, one stderr line naming the flag);
the sim's link profiles (built-in and JSON) and the hello's role and address."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from stepahead.plan import WorkerRole
from worker_service.config import WorkerConfig
from worker_service.sim.profiles import BUILTIN_LINKS, LinkProfile, load_link_profile

FAIL_WITHIN_S = 60.0  # generous on a loaded 2-core host; the failures come before any model loads


def _worker(*flags: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    proc = subprocess.run([sys.executable, "-m", "cli", "worker", *flags], capture_output=True, text=True,
                          timeout=FAIL_WITHIN_S)
    return proc, [line for line in proc.stderr.splitlines() if line.strip()]


def test_a_role_with_tensor_parallelism_exits_2_with_one_line() -> None:
    proc, lines = _worker("--role", "prefill", "--tensor-parallel-size", "2")
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "--role prefill" in lines[0] and "--tensor-parallel-size 2" in lines[0]


def test_a_kv_transfer_port_that_cannot_be_bound_exits_2_naming_the_flag() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = str(holder.getsockname()[1])
        proc, lines = _worker("--role", "prefill", "--kv-transfer-port", port, "--device", "sim")
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"--kv-transfer-port {port}" in lines[0]


def test_an_unknown_sim_link_exits_2_naming_it() -> None:
    proc, lines = _worker("--device", "sim", "--sim-kv-link", "carrier-pigeon")
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "carrier-pigeon" in lines[0]


def test_defaults() -> None:
    config = WorkerConfig()
    assert config.role is WorkerRole.BOTH and not config.serves_kv_transfer
    assert (config.kv_transfer_host, config.kv_transfer_port, config.kv_transfer_advertise_host) == ("127.0.0.1", 0,
                                                                                                     None)
    assert config.kv_transfer_timeout == 30.0 and config.sim_kv_link == "ib"
    assert WorkerConfig(role=WorkerRole.PREFILL).serves_kv_transfer


def test_builtin_links_and_transfer_time() -> None:
    assert set(BUILTIN_LINKS) == {"nvlink", "ib", "pcie"}
    assert load_link_profile("ib").bandwidth == 50e9 and load_link_profile("nvlink").bandwidth == 450e9
    link = LinkProfile("x", bandwidth=1e9, latency_s=0.5)
    assert link.transfer_seconds(2e9) == pytest.approx(2.5)


def test_a_link_from_json_and_its_errors(tmp_path) -> None:
    path = tmp_path / "roce.json"
    path.write_text(json.dumps({"bandwidth": 25e9, "latency_s": 8e-6}))
    assert load_link_profile(str(path)) == LinkProfile("roce", 25e9, 8e-6)
    path.write_text(json.dumps({"bandwidth": 25e9, "latency": 1}))
    with pytest.raises(ValueError, match="unknown keys"):
        load_link_profile(str(path))
    path.write_text(json.dumps({"bandwidth": 0, "latency_s": 0}))
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        load_link_profile(str(path))


def test_the_hello_carries_the_role(tiny_model_dir) -> None:
    from worker_service.runners import build_runner, worker_info

    config = WorkerConfig(device="sim", model=str(tiny_model_dir), role=WorkerRole.DECODE, num_gpu_blocks_override=8)
    runner, model_dir = build_runner(config)
    assert worker_info(config, runner, model_dir).role is WorkerRole.DECODE


from tests.fixtures_models import tiny_model_dir  # noqa: E402,F401


def _serve(*flags: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    proc = subprocess.run([sys.executable, "-m", "cli", "serve", *flags], capture_output=True, text=True,
                          timeout=FAIL_WITHIN_S)
    return proc, [line for line in proc.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("flags, named", [
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--tensor-parallel-size", "2"], "--tensor-parallel-size 2"),
    (["--prefill-replicas", "2"], "--decode-replicas 0"),
    (["--prefill-replicas", "-1"], "--prefill-replicas"),
])
def test_serve_refuses_disaggregation_it_cannot_run(flags, named) -> None:
    proc, lines = _serve("--device", "sim", "--port", "0", "--http-port", "0", *flags)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert named in lines[0], lines


def test_serve_starts_prefill_workers_with_a_kv_port_each_then_decode_workers() -> None:
    from cli.serve import ServeConfig, worker_roles

    plain = worker_roles(ServeConfig(data_parallel_size=2), WorkerConfig(), [])
    assert plain == [("worker", []), ("worker1", [])]
    roles = worker_roles(ServeConfig(prefill_replicas=2, decode_replicas=1), WorkerConfig(), [4001, 4002])
    assert [name for name, _ in roles] == ["prefill0", "prefill1", "decode0"]
    assert roles[1][1] == ["--role", "prefill", "--kv-transfer-host", "127.0.0.1", "--kv-transfer-port", "4002"]
    assert roles[2][1] == ["--role", "decode"]
