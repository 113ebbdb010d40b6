"""The cluster files run: `docker-compose.yml`'s services started as local processes (no
Docker engine here) at worker=2, gateway=2, with traffic through both gateways; the
Kubernetes manifests validated against the Kubernetes schemas, and every container's
arguments parsed by the real CLI. Neither file can drift from the CLI unnoticed."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml

from cli import COMMANDS
from stepahead.ports import free_port
from stepahead.v1 import common_pb2, generation_pb2_grpc
from tests.service.streams import greedy

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
K8S = ROOT / "deploy" / "kubernetes"


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """What `stepahead ...` would make of argv (SystemExit on an unknown flag)."""
    assert argv[0] == "stepahead", argv
    help_text, module = COMMANDS[argv[1]]
    parser = argparse.ArgumentParser(prog=f"stepahead {argv[1]}", exit_on_error=False)
    importlib.import_module(module).add_arguments(parser)
    return parser.parse_args(argv[2:])


def local_command(argv: list[str], ports: dict[str, int], models: Path, own_port: int | None,
                  health_port: int | None = None) -> list[str]:
    """A compose command as a local process: service names resolve to 127.0.0.1 and each
    service's listening ports become free ones."""
    out = []
    for arg in argv:
        for name, port in ports.items():
            arg = arg.replace(f"{name}:50051", f"127.0.0.1:{port}")
        arg = arg.replace("/models", str(models)).replace("0.0.0.0", "127.0.0.1")
        out.append(arg)
    if own_port is not None:
        out[out.index("--port") + 1] = str(own_port)
    if health_port is not None:
        out[out.index("--health-port") + 1] = str(health_port)
    if "--http-port" in out:
        out[out.index("--http-port") + 1] = str(free_port())
    if out[0] == "stepahead":
        out = [sys.executable, "-m", "cli", *out[1:]]
    return out


def healthy(service: dict, port: int) -> bool:
    test = service["healthcheck"]["test"][1:]  # ["CMD", ...]
    argv = [sys.executable if a == "python" else a for a in test]
    for fixed in ("127.0.0.1:50050", "127.0.0.1:50051", "127.0.0.1:50052"):  # gateway, scheduler, worker health
        argv = [a.replace(fixed, f"127.0.0.1:{port}") for a in argv]
    return subprocess.run(argv, capture_output=True).returncode == 0


def wait_healthy(service: dict, port: int, procs: list[subprocess.Popen], timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    tick = threading.Event()
    while not healthy(service, port):  # the compose health check itself, as Docker runs it
        assert all(p.poll() is None for p in procs), "a service exited"
        assert time.monotonic() < deadline, f"not healthy on {port}"
        tick.wait(0.2)


def test_compose_services_run_as_processes_at_two_workers_and_two_gateways(tmp_path):
    start = time.monotonic()
    services = COMPOSE["services"]
    assert services["scheduler"]["environment"]["STEPAHEAD_CLUSTER_TOKEN"].startswith("${STEPAHEAD_CLUSTER_TOKEN:?")
    env = dict(os.environ, STEPAHEAD_LOG_LEVEL="warning", STEPAHEAD_CLUSTER_TOKEN="compose-test-token",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # `stepahead` in sh -c
    procs: list[subprocess.Popen] = []
    sched_port = free_port()
    ports = {"scheduler": sched_port}
    try:
        model = services["model"]["command"]
        assert subprocess.run(local_command(model, ports, tmp_path, None), env=env, timeout=300).returncode == 0
        assert (tmp_path / "tiny" / "config.json").exists()
        scheduler = services["scheduler"]
        procs.append(subprocess.Popen(local_command(scheduler["command"], ports, tmp_path, sched_port), env=env))
        worker_health_ports = [free_port(), free_port()]
        for port in worker_health_ports:  # --scale worker=2
            procs.append(subprocess.Popen(local_command(services["worker"]["command"], ports, tmp_path, None, port),
                                          env=env))
        wait_healthy(scheduler, sched_port, procs)
        for port in worker_health_ports:  # each worker's own check: attached as a replica
            wait_healthy(services["worker"], port, procs)
        gateway_ports = [free_port(), free_port()]  # --scale gateway=2
        for port in gateway_ports:
            procs.append(subprocess.Popen(local_command(services["gateway"]["command"], ports, tmp_path, port),
                                          env=env))
        for port in gateway_ports:
            wait_healthy(services["gateway"], port, procs)
        for port in gateway_ports:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # the public API: no cluster token
                stub = generation_pb2_grpc.GenerationStub(channel)
                for prompt in ([5, 6, 7], [9, 10, 11, 12]):
                    msgs = list(stub.Generate(greedy(prompt, 8), timeout=120))
                    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
                    assert sum(len(m.token_ids) for m in msgs) == 8
        print(f"compose-as-processes wall time: {time.monotonic() - start:.1f} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait(timeout=30)


def test_compose_file_shape():
    services = COMPOSE["services"]
    assert {"model", "scheduler", "worker", "gateway", "worker-gpu"} <= services.keys()
    for name in ("scheduler", "worker", "gateway"):
        assert services[name]["restart"] == "unless-stopped"
        assert "ports" not in services[name] or all(":" not in str(p) for p in services[name]["ports"]), \
            "a fixed host port cannot scale"
        parse_cli(services[name]["command"])
    for name in ("worker", "worker-gpu"):  # the health check asks the port the worker serves health on
        command, test = services[name]["command"], services[name]["healthcheck"]["test"]
        assert test[-1] == f"127.0.0.1:{command[command.index('--health-port') + 1]}", (command, test)
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"] and gpu["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    parse_cli(gpu["command"])


def _k8s_documents() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def test_kubernetes_manifests_validate_against_the_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    docs = _k8s_documents()
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
    assert kinds == sorted([
        "Namespace/stepahead", "Deployment/scheduler", "Service/scheduler", "PodDisruptionBudget/scheduler",
        "Deployment/worker", "PodDisruptionBudget/worker", "Deployment/gateway", "Service/gateway",
        "HorizontalPodAutoscaler/gateway", "PodDisruptionBudget/gateway",
    ])
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
        if doc["kind"] == "Deployment":
            pod = doc["spec"]["template"]["spec"]
            for container in [*pod.get("initContainers", []), *pod["containers"]]:
                parse_cli(container["args"])
    for doc in docs:
        if doc["kind"] == "Deployment":
            env = doc["spec"]["template"]["spec"]["containers"][0]["env"]
            assert any(e["name"] == "STEPAHEAD_CLUSTER_TOKEN" and "secretKeyRef" in e["valueFrom"] for e in env)
    worker = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "worker")
    container = worker["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    health_port = int(parse_cli(container["args"]).health_port)
    assert parse_cli(container["args"]).health_host == "0.0.0.0", "the kubelet probes the pod's address"
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == health_port, probe


def test_a_broken_manifest_is_caught():
    """The validation can fail: a typo in a field name is rejected."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    doc = next(d for d in _k8s_documents() if d["kind"] == "Service")
    doc["spec"]["portz"] = doc["spec"].pop("ports")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        parse_cli(["stepahead", "scheduler", "--no-such-flag", "1"])
