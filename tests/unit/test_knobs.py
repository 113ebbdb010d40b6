"""Each knob is declared once: the shared groups (`stepahead.knobs`) and the scheduling
knobs (`SchedulingConfig`) are the only declarations of their fields among every config
class, and each daemon, the simulator and `serve` compose them."""

from __future__ import annotations

import dataclasses

from cli.serve import ServeConfig, served_fields, served_groups
from cli.simulate import SIMULATED_GROUPS, SimulateConfig
from gateway.server import GatewayConfig
from scheduler_service.core.config import SchedulerConfig, SchedulingConfig
from scheduler_service.server import SchedulerDaemonConfig
from stepahead import knobs
from stepahead.knobs import fields_of
from worker_service.config import SERVED_GROUPS, WorkerConfig

CONFIGS = (GatewayConfig, SchedulerDaemonConfig, SchedulerConfig, WorkerConfig, ServeConfig, SimulateConfig)
SHARED = (knobs.StepBudgetConfig, knobs.SpeculativeFlag, knobs.KVCacheConfig, knobs.SimDeviceConfig, SchedulingConfig)


def declarations(field_name: str) -> set[type]:
    """Every class in the configs' hierarchies whose own body declares `field_name`."""
    classes = {c for config in CONFIGS for c in config.__mro__ if dataclasses.is_dataclass(c)}
    return {c for c in classes if field_name in c.__dict__.get("__annotations__", {})}


def test_every_shared_knob_has_one_declaration():
    for group in SHARED:
        for name in group.__dict__["__annotations__"]:
            if name == "block_size":  # the core also holds the value a worker announced, with the one default
                assert declarations(name) == {group, SchedulerConfig}
                block_size = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}["block_size"]
                assert block_size == knobs.DEFAULT_BLOCK_SIZE == knobs.KVCacheConfig().block_size
                continue
            assert declarations(name) == {group}, name


def test_the_daemons_and_the_simulator_compose_the_groups():
    assert issubclass(SchedulerDaemonConfig, (SchedulingConfig, knobs.SpeculativeFlag))
    assert issubclass(SchedulerConfig, SchedulingConfig), "the core's knobs are the daemon's, not a copy"
    for group in (knobs.StepBudgetConfig, knobs.SpeculativeFlag, knobs.KVCacheConfig, knobs.SimDeviceConfig):
        assert issubclass(WorkerConfig, group)
    assert issubclass(SimulateConfig, (knobs.KVCacheConfig, knobs.SimDeviceConfig))
    assert set(fields_of(*SIMULATED_GROUPS)) <= set(fields_of(SchedulerDaemonConfig))


def test_the_core_takes_every_scheduling_knob_from_the_daemon():
    from stepahead.plan import WorkerInfo

    daemon = SchedulerDaemonConfig(max_num_seqs=7, score_ttft_target=1.5, max_concurrent_batches=4,
                                   adaptive_concurrent_batches=False, max_queued_requests=9)
    core = daemon.core_config(WorkerInfo("w", "m", "llama", "float32", "cpu", 32, 100, 4, 512, 1000, (2,)))
    for name in fields_of(SchedulingConfig):
        assert getattr(core, name) == getattr(daemon, name), name
    assert (core.block_size, core.num_gpu_blocks, core.num_cpu_blocks, core.max_model_len) == (32, 100, 4, 512)


def test_serve_hands_each_daemon_its_groups_and_declares_each_flag_once():
    groups = served_groups()
    assert set(served_fields("worker")) == set(fields_of(*SERVED_GROUPS))
    assert {"max_num_seqs", "max_num_batched_tokens", "speculative_config"} <= \
        set(served_fields("worker")) & set(served_fields("scheduler")), "the step budget reaches both"
    every = [f for gs in groups.values() for g in gs for f in fields_of(g)]
    assert not set(every) & set(fields_of(ServeConfig))
    for daemon, config in (("scheduler", SchedulerDaemonConfig), ("worker", WorkerConfig), ("gateway", GatewayConfig)):
        assert set(served_fields(daemon)) <= set(fields_of(config)), daemon
