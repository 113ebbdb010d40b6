"""`serve`'s CPU layout: the flag when given, else pinned unless the model is big for the machine."""

from __future__ import annotations

import pytest

from cli.serve import BIG_MODEL_PARAMS, FEW_CORES, cpu_layout
from tests.fixtures_models import smollm2_model_dir, tiny_model_dir  # noqa: F401


@pytest.mark.parametrize("flag", [True, False])
def test_the_flag_wins(flag):
    for params in (1, BIG_MODEL_PARAMS * 10):
        for cores in (2, 64):
            assert cpu_layout(flag, params, cores) is flag


def test_auto_pins_a_small_model_and_many_cores_and_not_a_big_model_on_few():
    assert cpu_layout(None, BIG_MODEL_PARAMS - 1, 2) is True  # tiny: the control plane keeps its core
    assert cpu_layout(None, BIG_MODEL_PARAMS, FEW_CORES - 1) is False  # smollm2 / 100m on 2 cores
    assert cpu_layout(None, BIG_MODEL_PARAMS * 100, FEW_CORES) is True  # a core is a small share of many


def test_the_built_in_models_fall_where_they_were_measured(tiny_model_dir, smollm2_model_dir):  # noqa: F811
    from worker_service.model_config import ModelConfig

    assert ModelConfig.from_dir(tiny_model_dir).num_parameters() < BIG_MODEL_PARAMS
    assert ModelConfig.from_dir(smollm2_model_dir).num_parameters() >= BIG_MODEL_PARAMS
