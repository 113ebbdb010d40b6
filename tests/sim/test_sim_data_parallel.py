"""`stepahead serve --data-parallel-size 2` with sim workers: serve is ready once both
replicas attached (each worker's own health port SERVING: distinct ports), requests spread
over both (per-replica metrics lanes), and every output is the sim reference."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from stepahead.plan import SamplingParams
from stepahead.v1 import scheduler_pb2
from tests.service.harness import Serve
from tests.service.streams import wait_health
from tests.sim.test_sim_e2e import to_proto
from worker_service.sim.profiles import load_profile
from worker_service.sim.runner import SimRunner
from worker_service.sim.tokens import reference_output


def test_serve_starts_n_replicas_and_spreads_requests(sim_model_dir, fast_profile):
    runner = SimRunner(sim_model_dir, load_profile("h200"), num_blocks=64, eos_probability=0.05)
    work = [([7 + i, 8, 9, 10 + i], SamplingParams(temperature=1.0, max_tokens=24, seed=i)) for i in range(16)]
    flags = ["--device", "sim", "--sim-profile", str(fast_profile), "--sim-eos-probability", "0.05",
             "--data-parallel-size", "2", "--routing-policy", "round_robin"]
    with Serve(sim_model_dir, *flags) as serve:
        assert len(serve.stats().replicas) == 2, "serve is ready once every worker attached"
        health_ports = set()
        for pid in serve.child_pids():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if argv[3] == "worker":
                health_ports.add(argv[argv.index("--health-port") + 1])
        assert len(health_ports) == 2, health_ports  # one port each: no clash
        for port in health_ports:
            wait_health(f"127.0.0.1:{port}", serving=True, timeout_s=10)
        with ThreadPoolExecutor(len(work)) as pool:
            outputs = list(pool.map(lambda w: [t for m in serve.gateway.Generate(to_proto(*w), timeout=120)
                                               for t in m.token_ids], work))
        for (prompt, s), got in zip(work, outputs):
            assert got == reference_output(runner.rule, prompt, s, runner.max_model_len)
        record = serve.scheduler.GetFlightRecord(scheduler_pb2.GetFlightRecordRequest(), timeout=10)
        replicas = record.worker_id.split(",")
        assert len(replicas) == 2, record.worker_id
        assert {s.replica for s in record.steps} == set(replicas), "both replicas ran steps"
