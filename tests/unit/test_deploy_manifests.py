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
