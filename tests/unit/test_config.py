"""Daemon configs come from flags, else STEPAHEAD_* variables, else defaults."""

from __future__ import annotations

import argparse

import pytest

from scheduler_service.config import PreemptionMode, SchedulingPolicy
from scheduler_service.server import SchedulerDaemonConfig
from stepahead import config as cfg


def parse(argv: list[str]) -> SchedulerDaemonConfig:
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, SchedulerDaemonConfig)
    return cfg.from_args(SchedulerDaemonConfig, parser.parse_args(argv))


def test_defaults() -> None:
    c = parse([])
    assert c.async_scheduling and c.max_num_seqs == 256 and c.scheduling_policy is SchedulingPolicy.FCFS


def test_environment_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPAHEAD_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("STEPAHEAD_ASYNC_SCHEDULING", "false")
    monkeypatch.setenv("STEPAHEAD_PREEMPTION_MODE", "swap")
    c = parse([])
    assert c.max_num_seqs == 7 and not c.async_scheduling and c.preemption_mode is PreemptionMode.SWAP
    c = parse(["--max-num-seqs", "9", "--async-scheduling", "--scheduling-policy", "priority"])
    assert c.max_num_seqs == 9 and c.async_scheduling and c.scheduling_policy is SchedulingPolicy.PRIORITY


def test_bad_environment_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPAHEAD_MAX_NUM_SEQS", "many")
    with pytest.raises(cfg.ConfigError, match="STEPAHEAD_MAX_NUM_SEQS"):
        parse([])


def test_round_trip_to_flags() -> None:
    c = parse(["--no-enable-prefix-caching", "--max-num-batched-tokens", "512", "--preemption-mode", "swap"])
    names = ["enable_prefix_caching", "max_num_batched_tokens", "preemption_mode"]
    assert parse(cfg.to_flags(c, names)) == c
