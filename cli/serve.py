"""`stepahead serve`: scheduler, worker(s) and gateway as OS processes, one command.

Starts the scheduler, then `--data-parallel-size` × `--tensor-parallel-size` workers that
attach to it (one replica per data-parallel rank; with k > 1 the scheduler groups each k
workers into one tensor-parallel replica), or, disaggregated, `--prefill-replicas` workers
with `--role prefill` (each with its own `--kv-transfer-port`) and `--decode-replicas` with
`--role decode`; each worker has its own `--health-port` on loopback,
then the gateway; waits until the scheduler, every worker (attached) and the gateway report
SERVING on gRPC health; prints
the endpoint. The internal plane stays on loopback and carries a cluster token made for
this run (or STEPAHEAD_CLUSTER_TOKEN), handed to the children in their environment.

A child that dies unexpectedly is restarted with exponential backoff (workers re-attach,
gateways reconnect by themselves). SIGINT/SIGTERM drains: the gateway first (its open
streams finish, up to --drain-timeout), then the scheduler and the worker. Children also
get SIGTERM from the kernel if this process dies (PR_SET_PDEATHSIG), so nothing is orphaned.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from stepahead import config as cfg
from stepahead import security
from stepahead.knobs import fields_of
from cli import runfile
from model_zoo.builtin_models import DEFAULT_MODEL, MODEL_HELP
from stepahead.ports import check_free, free_port, free_ports

HEALTHY_RUN_S = 600.0  # a daemon that ran this long before it died starts its restart count over (the kubelet's rule)
MAX_BACKOFF_S = 30.0  # the longest wait before a restart


@dataclass(frozen=True)
class ServeConfig:
    model: str = cfg.field(DEFAULT_MODEL, MODEL_HELP)
    host: str = cfg.field("127.0.0.1", "gateway listen address")
    port: int = cfg.field(50050, "gateway port (0 picks a free one)")
    http_port: int = cfg.field(8000, "gateway's OpenAI-compatible HTTP port (0 disables HTTP)")
    scheduler_port: int = cfg.field(0, "scheduler port (0 picks a free one)")
    data_parallel_size: int = cfg.field(1, "workers to start: each attaches as a replica with its own KV pool")
    prefill_replicas: int = cfg.field(
        0, "disaggregated prefill/decode: workers started with --role prefill (each serves its prefilled KV on "
        "a port of its own); with --decode-replicas, instead of --data-parallel-size (0: off)")
    decode_replicas: int = cfg.field(
        0, "disaggregated prefill/decode: workers started with --role decode, which load the KV of prompts the "
        "prefill workers computed (0: off)")
    startup_timeout_s: float = cfg.field(600.0, "give up if not healthy after this long")
    pin_cpus: bool | None = cfg.field(
        None, "CPU device: worker on all cores but the last, the rest on the last (default: auto, see "
        "cpu_layout: pinned unless the model is big for the machine)")
    api_key: str | None = cfg.field(None, "API keys the gateway requires (comma list; env recommended)")
    max_restarts: int = cfg.field(10, "restarts of a crashing daemon in a row before serve gives up (a daemon "
                                  f"that ran {HEALTHY_RUN_S / 60:.0f} minutes before it died starts the count over)")
    log_level: str = cfg.field("info", "log level of every daemon")


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the parent dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: serve's own signal handling still stops the children


def spawn(args: list[str], cpus: set[int] | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
    def setup() -> None:  # runs in the child before exec
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return subprocess.Popen([sys.executable, "-m", "cli", *args], preexec_fn=setup,
                            env=dict(os.environ, **(env or {})), stderr=subprocess.PIPE, text=True)


def _forward_stderr(child: Child) -> None:
    """Copy a child's stderr to ours line by line, keeping its last line: the reason serve
    gives when that child dies during start-up."""
    for line in child.proc.stderr:
        sys.stderr.write(line)
        sys.stderr.flush()
        if line.strip():
            child.last_line = line.strip()


@dataclasses.dataclass
class Child:
    """One supervised daemon: how to start it, and its restarts so far."""

    name: str
    args: list[str]
    cpus: set[int] | None
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restarts: int = 0  # restarts in a row (since it last ran HEALTHY_RUN_S)
    next_start: float = 0.0
    last_line: str = ""
    started_at: float = 0.0  # monotonic time of the last start

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.proc = spawn(self.args, self.cpus, self.env)
        self.last_line = ""
        threading.Thread(target=_forward_stderr, args=(self,), name=f"{self.name}-stderr", daemon=True).start()

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None


# `--pin-cpus` auto: a model this large, on fewer cores than this, runs unpinned on every core.
# Pinning gives the control plane a core of its own, so planning and streaming never stall the
# forward pass's threads; it costs the forward pass 1/cores of the machine, which a small model
# does not miss and a large one on a few cores does (benchmarks/compare.py, docs/benchmarks.md).
BIG_MODEL_PARAMS = 20_000_000
FEW_CORES = 4


def cpu_layout(pin_cpus: bool | None, num_params: int, cores: int) -> bool:
    """Whether `serve` pins the worker apart from the control plane on a CPU device: the flag
    when given, else auto (pinned unless a model of BIG_MODEL_PARAMS or more runs on fewer than
    FEW_CORES cores)."""
    if pin_cpus is not None:
        return pin_cpus
    return not (num_params >= BIG_MODEL_PARAMS and cores < FEW_CORES)


def cpu_split(device: str) -> tuple[set[int] | None, set[int] | None]:
    """(worker cpus, scheduler+gateway cpus) when the CPU is the device, else (None, None).

    The worker's intra-op threads stall at every parallel region's barrier when another
    process takes one of their cores; pinning keeps the control plane off the device's cores.
    """
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if device != "cpu" or len(allowed) < 2:
        return None, None
    return set(allowed[:-1]), {allowed[-1]}


def wait_healthy(address: str, procs: list[subprocess.Popen], deadline: float, stop: threading.Event) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and not stop.is_set():
            if any(p.poll() is not None for p in procs):
                return False
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass  # not up yet
            stop.wait(0.1)  # poll interval of the readiness probe
    return False


def stop_one(p: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL after timeout_s."""
    if p.poll() is None:
        p.terminate()
    try:
        p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def shutdown(procs: list[subprocess.Popen], drain_timeout_s: float = 30.0, timeout_s: float = 10.0) -> None:
    """Gateway first (it drains its open streams), then the others together."""
    *rest, gateway = procs
    stop_one(gateway, drain_timeout_s + timeout_s)
    for p in rest:
        if p.poll() is None:
            p.terminate()
    for p in rest:
        stop_one(p, timeout_s)


def restart_delay(child: Child, now: float, max_restarts: int) -> float | None:
    """Seconds before `child`, found dead at `now`, starts again (0.5 s doubling to
    MAX_BACKOFF_S), or None when it has died more than `max_restarts` times in a row. A death
    after HEALTHY_RUN_S of running is a new incident, not part of a crash loop: it starts the
    count over, so a long-running server survives an occasional crash however many it sees."""
    if now - child.started_at >= HEALTHY_RUN_S:
        child.restarts = 0
    if child.restarts >= max_restarts:
        return None
    return min(0.5 * 2**child.restarts, MAX_BACKOFF_S)


def supervise(children: list[Child], stop: threading.Event, max_restarts: int) -> int:
    """Restart children that die (`restart_delay`); 0 when stopped, 1 when a child keeps dying."""
    while not stop.wait(0.2):
        now = time.monotonic()
        for child in children:
            if not child.exited():
                continue
            if child.next_start == 0.0:  # just noticed
                delay = restart_delay(child, now, max_restarts)
                if delay is None:
                    print(f"stepahead: {child.name} died {child.restarts + 1} times in a row; shutting down",
                          file=sys.stderr, flush=True)
                    return 1
                print(f"stepahead: {child.name} exited (code {child.proc.returncode}); restarting in {delay:.1f}s",
                      file=sys.stderr, flush=True)
                child.next_start = now + delay
            elif now >= child.next_start:
                child.restarts += 1
                child.next_start = 0.0
                child.start()
    return 0


def served_groups() -> dict[str, tuple[type, ...]]:
    """The flag groups serve declares and hands on, per daemon (each knob once: a group two
    daemons share, like the step budget, is one set of flags that reaches both)."""
    from gateway.server import GatewayServingConfig
    from scheduler_service.server import SchedulerEngineConfig
    from scheduler_service.core.config import SchedulingConfig
    from stepahead.knobs import SpeculativeFlag
    from worker_service.config import SERVED_GROUPS

    return {"scheduler": (SchedulingConfig, SpeculativeFlag, SchedulerEngineConfig), "worker": SERVED_GROUPS,
            "gateway": (GatewayServingConfig,)}


def served_fields(daemon: str) -> tuple[str, ...]:
    return fields_of(*served_groups()[daemon])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_positional", nargs="?", metavar="MODEL",
                        help="the model, as `--model` (`stepahead serve MODEL`, as `vllm serve MODEL`)")
    cfg.add_arguments(parser, ServeConfig)
    declared = set(fields_of(ServeConfig))
    for groups in served_groups().values():
        for group in groups:
            cfg.add_arguments(parser, group, exclude=tuple(declared))
            declared.update(fields_of(group))


def run(args: argparse.Namespace) -> int:
    from gateway.server import GatewayConfig
    from scheduler_service.server import SchedulerDaemonConfig
    from worker_service.daemon import WorkerConfig

    if args.model_positional is not None:
        args.model = args.model_positional
    config = cfg.from_args(ServeConfig, args)
    gateway_cfg = cfg.from_args(GatewayConfig, args)
    sched_cfg = cfg.from_args(SchedulerDaemonConfig, args)
    worker_cfg = cfg.from_args(WorkerConfig, args)
    check_ports(config)
    check_disaggregation(config, worker_cfg)
    security.split_keys(config.api_key)  # an empty --api-key is refused, not passed on as "no keys"
    if worker_cfg.served_model_name is None:  # vLLM's rule: the --model argument, as given
        worker_cfg = dataclasses.replace(worker_cfg, served_model_name=config.model)
    model_dir = str(prepare_model(config.model, worker_cfg.tokenizer))
    num_params = check_checkpoint(model_dir, worker_cfg).num_parameters() if worker_cfg.device != "sim" else 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    pin = cpu_layout(config.pin_cpus, num_params, cores)
    worker_cpus, control_cpus = cpu_split(worker_cfg.device) if pin else (None, None)
    if worker_cfg.device == "cpu" and worker_cfg.num_threads is None:
        # The CPU is the device: pinned, the worker's threads own every core but the one the
        # scheduler and the gateway plan and stream on; unpinned, they take every core.
        # Each replica gets its share.
        replicas = max(len(worker_roles(config, worker_cfg, [0] * config.prefill_replicas)), 1)
        share = max(1, (cores - 1 if worker_cpus else cores) // replicas)
        worker_cfg = dataclasses.replace(worker_cfg, num_threads=share)
    named = {config.port, config.http_port, config.scheduler_port}  # the flags' ports: not to be picked again
    port = config.port or free_port(config.host, exclude=named)
    num_workers = len(worker_roles(config, worker_cfg, [0] * config.prefill_replicas))
    sched_port, *picked = free_ports(1 + num_workers + config.prefill_replicas, exclude=named | {port})
    health_ports, kv_ports = picked[:num_workers], picked[num_workers:]
    roles = worker_roles(config, worker_cfg, kv_ports)
    sched_addr = f"127.0.0.1:{config.scheduler_port or sched_port}"
    log = ["--log-level", config.log_level]
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    token = {"STEPAHEAD_CLUSTER_TOKEN": os.environ.get("STEPAHEAD_CLUSTER_TOKEN") or secrets.token_urlsafe(32)}
    gateway_env = dict(token, **({"STEPAHEAD_API_KEY": config.api_key} if config.api_key else {}))
    children = [
        Child("scheduler", ["scheduler", "--host", "127.0.0.1", "--port", sched_addr.split(":")[1], *log,
                            *cfg.to_flags(sched_cfg, served_fields("scheduler"))], control_cpus, token),
        *(Child(name, ["worker", "--scheduler", sched_addr, "--model", model_dir, *log,
                       "--health-port", str(health_port), *role_flags,
                       *cfg.to_flags(worker_cfg, served_fields("worker"))],
                worker_cpus, token)
          for (name, role_flags), health_port in zip(roles, health_ports)),
        Child("gateway", ["gateway", "--scheduler", sched_addr, "--host", config.host, "--port", str(port),
                          "--http-port", str(config.http_port), "--model", model_dir,
                          *cfg.to_flags(gateway_cfg, served_fields("gateway")), *log],
              control_cpus, gateway_env),
    ]
    run_file = None
    for child in children:
        child.start()
    try:
        deadline = time.monotonic() + config.startup_timeout_s
        workers = [f"127.0.0.1:{p}" for p in health_ports]  # SERVING: attached as a replica
        for address in (sched_addr, *workers, f"{config.host}:{port}"):
            if not wait_healthy(address, [c.proc for c in children], deadline, stop):
                if stop.is_set():
                    return 0
                return _startup_failed(children, address, config.startup_timeout_s)
        http = f" http at http://{config.host}:{config.http_port}" if config.http_port else ""
        run_file = runfile.write({"scheduler": sched_addr, "cluster_token": token["STEPAHEAD_CLUSTER_TOKEN"],
                                  "gateway": f"{config.host}:{port}", "model": config.model})
        print(f"stepahead ready: gateway at {config.host}:{port} (scheduler at {sched_addr}){http}", flush=True)
        print(f"stepahead: `stepahead trace` and `stepahead bench --scheduler` find the scheduler and its cluster"
              f" token in {run_file} (readable only by you)", flush=True)
        return supervise(children, stop, config.max_restarts)
    finally:
        shutdown([c.proc for c in children], gateway_cfg.drain_timeout)
        if run_file is not None:
            run_file.unlink(missing_ok=True)


def disaggregated(config: ServeConfig) -> bool:
    return bool(config.prefill_replicas or config.decode_replicas)


def check_disaggregation(config: ServeConfig, worker_cfg) -> None:
    """--prefill-replicas / --decode-replicas: at least one of each, single-worker replicas
    (a role does not combine with tensor parallelism), and not with --data-parallel-size."""
    if not disaggregated(config):
        return
    if not (config.prefill_replicas and config.decode_replicas):
        raise cfg.ConfigError(f"--prefill-replicas {config.prefill_replicas} --decode-replicas "
                              f"{config.decode_replicas}: disaggregated serving needs at least one of each")
    if worker_cfg.tensor_parallel_size > 1:
        raise cfg.ConfigError(f"--prefill-replicas/--decode-replicas: prefill and decode workers run alone; they "
                              f"do not combine with --tensor-parallel-size {worker_cfg.tensor_parallel_size}")
    if config.data_parallel_size > 1:
        raise cfg.ConfigError(f"--prefill-replicas/--decode-replicas set the replicas; leave --data-parallel-size "
                              f"({config.data_parallel_size}) at 1")


def worker_roles(config: ServeConfig, worker_cfg, kv_ports: list[int]) -> list[tuple[str, list[str]]]:
    """(name, the role's flags) of each worker serve starts: `--data-parallel-size` ×
    `--tensor-parallel-size` plain workers, or the prefill workers (one of `kv_ports` each,
    on loopback like the rest of the internal plane) then the decode workers."""
    if not disaggregated(config):
        count = config.data_parallel_size * max(worker_cfg.tensor_parallel_size, 1)
        return [(f"worker{i}" if i else "worker", []) for i in range(count)]
    return ([(f"prefill{i}", ["--role", "prefill", "--kv-transfer-host", "127.0.0.1", "--kv-transfer-port", str(p)])
             for i, p in enumerate(kv_ports)]
            + [(f"decode{i}", ["--role", "decode"]) for i in range(config.decode_replicas)])


def prepare_model(spec: str, tokenizer: str | None):
    """The model's directory: a built-in model is built, a .gguf file converted, once, here
    (the daemons then find it in the cache); says so first, as it takes a while."""
    from model_zoo.builtin_models import cache_dir, resolve_model

    try:
        return resolve_model(spec, tokenizer=tokenizer, build=False)
    except cfg.NotBuiltYet:
        pass
    print(f"stepahead: preparing {spec} (once; cached under {cache_dir() / 'models'})", file=sys.stderr, flush=True)
    return resolve_model(spec, tokenizer=tokenizer)


def check_ports(config: ServeConfig) -> None:
    """A port a flag names that another process holds fails here, naming the port and the
    flag, before any daemon starts (each daemon would otherwise fail on it after loading)."""
    for flag, host, port in (("--port", config.host, config.port), ("--http-port", config.host, config.http_port),
                             ("--scheduler-port", "127.0.0.1", config.scheduler_port)):
        check_free(flag, host, port)


def check_checkpoint(model_dir: str, worker_cfg):
    """What the worker and the gateway would refuse, refused here before either starts: the
    checkpoint's config (`ModelConfig.from_dir`, returned), its weights against the host's
    memory on a CPU device (the worker checks a CUDA device itself), and the tokenizer the
    gateway loads."""
    from pathlib import Path

    from worker_service.model_config import CheckpointError, ModelConfig, check_fits, host_memory_bytes

    model_cfg = ModelConfig.from_dir(model_dir)
    if worker_cfg.device == "cpu":
        itemsize = {"bfloat16": 2, "float16": 2}.get(worker_cfg.dtype.value if worker_cfg.dtype else "float32", 4)
        check_fits(model_dir, model_cfg, itemsize, host_memory_bytes(), "the host")
    tokenizer = Path(model_dir) / "tokenizer.json"
    if not tokenizer.is_file():
        raise CheckpointError(f"{tokenizer}: no such file (the gateway's tokenizer)")
    return model_cfg


def _startup_failed(children: list[Child], address: str, timeout_s: float) -> int:
    """Name the daemon that failed and its last line; 2 when it refused its configuration
    (exit 2), so that the operator sees one reason rather than the next daemon's address."""
    dead = next((c for c in children if c.exited()), None)
    if dead is None:
        print(f"stepahead: {address} did not become healthy within --startup-timeout-s {timeout_s:g}",
              file=sys.stderr, flush=True)
        return 1
    time.sleep(0.2)  # its stderr forwarder reads the last lines
    print(f"stepahead: {dead.name} exited during start-up (code {dead.proc.returncode}): "
          f"{dead.last_line or 'no output'}", file=sys.stderr, flush=True)
    return 2 if dead.proc.returncode == 2 else 1
