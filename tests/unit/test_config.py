"""Daemon configs come from flags, else STEPAHEAD_* variables, else defaults."""

from __future__ import annotations

import argparse

import pytest

from scheduler_service.core.config import PreemptionMode, SchedulingPolicy
from scheduler_service.server import SchedulerDaemonConfig
from stepahead import config as cfg
from stepahead.plan import WorkerInfo


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


def test_score_ttft_target_reaches_the_scheduler_core_from_env_and_flag(monkeypatch) -> None:
    info = WorkerInfo("w", "m", "llama", "bfloat16", "sim", 16, 100, 0, 256, 512, (0,))
    assert parse([]).core_config(info).score_ttft_target == 0.0  # off by default
    monkeypatch.setenv("STEPAHEAD_SCORE_TTFT_TARGET", "2.5")
    assert parse([]).core_config(info).score_ttft_target == 2.5
    assert parse(["--score-ttft-target", "1"]).core_config(info).score_ttft_target == 1.0
    with pytest.raises(SystemExit) as refused:  # out of range: refused at parse time (argparse, exit 2)
        parse(["--score-ttft-target", "-1"])
    assert refused.value.code == 2


def test_a_bad_enum_value_lists_the_values(monkeypatch, capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        parse(["--scheduling-policy", "lifo"])
    assert refused.value.code == 2
    assert "argument --scheduling-policy: 'lifo' is not one of fcfs, priority" in capsys.readouterr().err
    monkeypatch.setenv("STEPAHEAD_SCHEDULING_POLICY", "lifo")
    with pytest.raises(cfg.ConfigError, match="STEPAHEAD_SCHEDULING_POLICY='lifo': 'lifo' is not one of fcfs"):
        parse([])


def test_every_dtype_the_flag_takes_is_one_the_loader_loads() -> None:
    from worker_service.config import WeightDType
    from worker_service.loader import DTYPES

    assert {d.value for d in WeightDType} == set(DTYPES)


def test_round_trip_to_flags() -> None:
    c = parse(["--no-enable-prefix-caching", "--max-num-batched-tokens", "512", "--preemption-mode", "swap"])
    names = ["enable_prefix_caching", "max_num_batched_tokens", "preemption_mode"]
    assert parse(cfg.to_flags(c, names)) == c


def test_a_list_field_takes_repeated_flags_comma_lists_and_env(monkeypatch):
    import argparse

    from gateway.server import GatewayConfig
    from stepahead import config as cfg

    def parse(*argv: str) -> GatewayConfig:
        parser = argparse.ArgumentParser()
        cfg.add_arguments(parser, GatewayConfig)
        return cfg.from_args(GatewayConfig, parser.parse_args(argv))

    assert parse().scheduler == ("127.0.0.1:50051",)
    assert parse("--scheduler", "a:1", "--scheduler", "b:2,c:3").scheduler == ("a:1", "b:2", "c:3")
    monkeypatch.setenv("STEPAHEAD_SCHEDULER", "x:1, y:2")
    assert parse().scheduler == ("x:1", "y:2")
    assert parse("--scheduler", "z:3").scheduler == ("z:3",)  # a flag beats the environment
    assert cfg.to_flags(parse("--scheduler", "a:1,b:2"), ["scheduler"]) == ["--scheduler", "a:1,b:2"]


def test_a_continuation_is_prompt_plus_streamed_with_the_rest_of_the_budget():
    from gateway.scheduler_pool import continuation
    from stepahead.v1 import common_pb2, scheduler_pb2

    msg = scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(
        max_tokens=10, min_tokens=3, seed=7, temperature=0.5))
    out = continuation(msg, [5, 6, 7, 8])
    assert list(out.prompt_token_ids) == [1, 2, 5, 6, 7, 8] and out.request_id == "r"
    assert (out.sampling.max_tokens, out.sampling.min_tokens, out.sampling.seed) == (6, 0, 7)
    assert list(msg.prompt_token_ids) == [1, 2] and msg.sampling.max_tokens == 10  # the original is untouched
