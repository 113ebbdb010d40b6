"""The deployment files read as a whole: every client reaches the Service it dials before the
pods behind it can be ready when their readiness waits for that client (the scheduler is
ready only once a worker attached, and workers attach through its Service); the image
installs what the Makefile installs (xgrammar, without triton) and says which torch it holds;
the build context leaves the virtual environment and .git out; compose names the token it
needs and how to make one."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
# pods whose readiness waits for a client that reaches them through their own Service
READY_ONLY_WITH_CLIENTS = {"scheduler": "SERVING once a worker attached (scheduler_service/server.py: Health)"}


def documents() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [d for name in kustomization["resources"] for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _dialed_services(container: dict) -> set[str]:
    args = container.get("args", [])
    return {args[i + 1].split(":")[0] for i, a in enumerate(args[:-1]) if a == "--scheduler"}


def test_every_dialed_service_routes_to_pods_whose_readiness_waits_for_the_dialer():
    docs = documents()
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    edges = [(name, target) for name, d in deployments.items()
             for c in d["spec"]["template"]["spec"]["containers"] for target in _dialed_services(c)]
    assert ("worker", "scheduler") in edges and ("gateway", "scheduler") in edges, edges
    for client, target in edges:
        service = services[target]  # a client dials a Service by its name
        selected = [n for n, d in deployments.items()
                    if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert selected == [target], (target, selected)
        pod = deployments[target]["spec"]["template"]["spec"]["containers"][0]
        gated = target in READY_ONLY_WITH_CLIENTS and "readinessProbe" in pod
        if gated:
            assert service["spec"].get("publishNotReadyAddresses") is True, (
                f"{client} reaches {target} only through Service/{target}, which routes to ready pods only, but "
                f"{target} is ready only once a {client} attached: set publishNotReadyAddresses")


def test_the_scheduler_readiness_probe_is_the_grpc_port_the_workers_dial():
    docs = documents()
    scheduler = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "scheduler")
    container = scheduler["spec"]["template"]["spec"]["containers"][0]
    port = int(container["args"][container["args"].index("--port") + 1])
    assert container["readinessProbe"]["grpc"]["port"] == port
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "scheduler")
    grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc_port["port"] == port and service["spec"]["publishNotReadyAddresses"] is True
    worker = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "worker")
    args = worker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--scheduler") + 1] == f"scheduler:{port}"


def test_the_manifests_still_validate_against_the_kubernetes_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in documents():
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def _makefile_pin(name: str) -> str:
    return re.search(rf"^{name}\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)


def test_the_image_installs_xgrammar_without_deps_and_names_its_torch():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"ARG XGRAMMAR={_makefile_pin('XGRAMMAR')}" in dockerfile
    assert re.search(r'pip install --no-cache-dir --no-deps "\$XGRAMMAR"', dockerfile)
    assert f"ARG TORCH={_makefile_pin('TORCH')}" in dockerfile
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in dockerfile  # the CPU build, said so
    assert '--index-url "$TORCH_INDEX" "$TORCH"' in dockerfile
    assert "--build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu" in dockerfile  # how to build a GPU image


def _ignored(patterns: list[str], path: str) -> bool:
    """Docker's rule, enough for these patterns: the last matching pattern wins ("!" re-includes)."""
    ignored = False
    for p in patterns:
        negate, p = p.startswith("!"), p.lstrip("!")
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(fnmatch.fnmatch(x, p) or fnmatch.fnmatch(x, p.removeprefix("**/")) or
               fnmatch.fnmatch(x.split("/")[-1], p.removeprefix("**/")) and p.startswith("**/") for x in prefixes):
            ignored = not negate
    return ignored


def test_the_build_context_leaves_out_the_venv_git_caches_and_plots_but_keeps_the_sources():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for path in (".venv/lib/python3.11/site-packages/torch/__init__.py", ".git/HEAD",
                 "gateway/__pycache__/server.cpython-311.pyc", ".pytest_cache/v/cache",
                 "benchmarks/results/capacity_h200_8b.png", "stepahead.egg-info/PKG-INFO"):
        assert _ignored(patterns, path), path
    for path in ("pyproject.toml", "README.md", "cli/__init__.py", "gateway/http_server.py",
                 "worker_service/sim/profiles.py", "protos/stepahead/v1/scheduler.proto", "Makefile"):
        assert not _ignored(patterns, path), path
        assert (ROOT / path).exists(), path


def test_compose_requires_the_cluster_token_and_says_how_to_make_one():
    text = (ROOT / "docker-compose.yml").read_text()
    compose = yaml.safe_load(text)
    token = compose["x-stepahead"]["environment"]["STEPAHEAD_CLUSTER_TOKEN"]
    assert token.startswith("${STEPAHEAD_CLUSTER_TOKEN:?") and "openssl rand -hex 32" in token
    assert "$(" not in token  # compose would read it as an interpolation
    assert "export STEPAHEAD_CLUSTER_TOKEN=$(openssl rand -hex 32)" in text
    gpu = compose["services"]["worker-gpu"]
    assert gpu["image"] == "stepahead:cuda" and "cu" in gpu["build"]["args"]["TORCH_INDEX"]
    readme = (ROOT / "README.md").read_text()
    assert "export STEPAHEAD_CLUSTER_TOKEN=$(openssl rand -hex 32)" in readme
    assert (ROOT / "docs" / "deployment.md").is_file() and "docs/deployment.md" in readme


# ---- disaggregated prefill/decode: the overlay and the compose services ---------------------

DISAGGREGATED = K8S / "disaggregated"


def _parse_worker(argv: list[str]):
    import argparse

    from worker_service.daemon import add_arguments

    assert argv[:2] == ["stepahead", "worker"], argv
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return parser.parse_args(argv[2:])


def disaggregated_documents() -> list[dict]:
    """What `kubectl apply -k deploy/kubernetes/disaggregated/` applies: the base without what
    the overlay's patches delete, plus its own resources."""
    overlay = yaml.safe_load((DISAGGREGATED / "kustomization.yaml").read_text())
    deleted = set()
    for patch in overlay["patches"]:
        doc = yaml.safe_load(patch["patch"])
        assert doc["$patch"] == "delete"
        deleted.add((doc["kind"], doc["metadata"]["name"]))
    assert overlay["resources"][0] == ".."
    own = [d for name in overlay["resources"][1:] for d in yaml.safe_load_all((DISAGGREGATED / name).read_text()) if d]
    return [d for d in documents() if (d["kind"], d["metadata"]["name"]) not in deleted] + own


def test_the_disaggregated_overlay_has_prefill_and_decode_workers_that_scale_apart():
    docs = disaggregated_documents()
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert "worker" not in deployments and {"worker-prefill", "worker-decode"} <= deployments.keys()
    budgets = {d["metadata"]["name"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert {"worker-prefill", "worker-decode"} <= budgets and "worker" not in budgets
    prefill, decode = (deployments[n]["spec"]["template"]["spec"]["containers"][0]
                       for n in ("worker-prefill", "worker-decode"))
    p, d = _parse_worker(prefill["args"]), _parse_worker(decode["args"])
    assert (p.role.value, d.role.value) == ("prefill", "decode")
    assert p.scheduler == d.scheduler == "scheduler:50051"
    kv_port = next(x for x in prefill["ports"] if x["name"] == "kv-transfer")["containerPort"]
    assert p.kv_transfer_port == kv_port and p.kv_transfer_host == "0.0.0.0"
    advertise = next(e for e in prefill["env"] if e["name"] == "STEPAHEAD_KV_TRANSFER_ADVERTISE_HOST")
    assert advertise["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"  # decode pods dial the pod itself
    for container, args in ((prefill, p), (decode, d)):
        assert container["readinessProbe"]["grpc"]["port"] == args.health_port
        assert any(e["name"] == "STEPAHEAD_CLUSTER_TOKEN" and "secretKeyRef" in e["valueFrom"]
                   for e in container["env"])
    selectors = [deployments[n]["spec"]["selector"]["matchLabels"] for n in ("worker-prefill", "worker-decode")]
    assert selectors[0] != selectors[1]  # scaled (and disrupted) apart


def test_the_disaggregated_manifests_validate_against_the_kubernetes_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in disaggregated_documents():
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_compose_has_prefill_and_decode_workers_in_a_profile():
    import shlex

    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    prefill, decode = services["worker-prefill"], services["worker-decode"]
    assert prefill["profiles"] == decode["profiles"] == ["disaggregated"]  # `up` alone starts plain workers
    shell = prefill["command"]
    assert shell[:2] == ["sh", "-c"] and shell[2].startswith("exec stepahead worker ")
    argv = shlex.split(shell[2].removeprefix("exec "))
    p = _parse_worker(argv)
    assert p.role.value == "prefill" and p.kv_transfer_host == "0.0.0.0" and p.kv_transfer_port == 50053
    assert p.kv_transfer_advertise_host.startswith("$$(hostname -i")  # compose passes `$(hostname -i ...)` to sh
    d = _parse_worker(decode["command"])
    assert d.role.value == "decode"
    for service, args in ((prefill, p), (decode, d)):
        assert service["healthcheck"]["test"][-1] == f"127.0.0.1:{args.health_port}"
