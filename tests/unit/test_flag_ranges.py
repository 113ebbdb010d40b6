"""Every numeric flag is checked against its range when parsed: argparse's one-line error."""

from __future__ import annotations

import argparse

import pytest

from stepahead import config as cfg


@pytest.mark.parametrize("name, raw", [
    ("block_size", "0"), ("block_size", "4096"), ("max_num_seqs", "0"), ("max_num_batched_tokens", "-1"),
    ("gpu_memory_utilization", "0"), ("gpu_memory_utilization", "2"), ("gpu_memory_utilization", "nan"),
    ("port", "70000"), ("port", "-1"), ("num_threads", "0"), ("startup_timeout_s", "0"),
    ("drain_timeout", "-1"), ("distributed_timeout", "inf"), ("served_model_name", ""), ("served_model_name", "  "),
])
def test_out_of_range_is_refused(name: str, raw: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"must be"):
        cfg.RANGES[name](raw)


@pytest.mark.parametrize("name, raw, value", [
    ("block_size", "16", 16), ("gpu_memory_utilization", "1", 1.0), ("port", "0", 0),
    ("max_wait_time", "inf", float("inf")), ("drain_timeout", "0", 0.0), ("served_model_name", "m", "m"),
])
def test_in_range_is_parsed(name: str, raw: str, value) -> None:
    assert cfg.RANGES[name](raw) == value


def test_a_daemon_config_flag_gets_its_range() -> None:
    from worker_service.daemon import WorkerConfig

    parser = argparse.ArgumentParser(exit_on_error=False)
    cfg.add_arguments(parser, WorkerConfig)
    with pytest.raises(argparse.ArgumentError, match="--block-size: must be in"):
        parser.parse_args(["--block-size", "0"])


def test_an_environment_variable_out_of_range_is_a_config_error(monkeypatch) -> None:
    from worker_service.daemon import WorkerConfig

    monkeypatch.setenv("STEPAHEAD_GPU_MEMORY_UTILIZATION", "2")
    with pytest.raises(cfg.ConfigError, match="STEPAHEAD_GPU_MEMORY_UTILIZATION"):
        cfg.add_arguments(argparse.ArgumentParser(), WorkerConfig)


def test_every_range_matches_the_kind_of_the_fields_named_after_it() -> None:
    import dataclasses
    import typing

    from gateway.server import GatewayConfig
    from scheduler_service.server import SchedulerDaemonConfig
    from cli.serve import ServeConfig
    from worker_service.daemon import WorkerConfig

    seen = set()
    for cls in (GatewayConfig, SchedulerDaemonConfig, ServeConfig, WorkerConfig):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in cfg.RANGES:
                seen.add(f.name)
                assert cfg.RANGES[f.name].kind is cfg._base_type(hints[f.name]), f.name
    assert set(cfg.RANGES) == seen  # no range for a flag that does not exist
