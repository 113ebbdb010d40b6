"""`build_sim_runner(WorkerConfig)`: the worker daemon's `--device sim` runner (no torch)."""

from __future__ import annotations

import json
from pathlib import Path

from stepahead.speculative import parse_speculative_config
from worker_service.sim.profiles import load_link_profile, load_profile
from worker_service.sim.runner import SimRunner


def checkpoint_dtype(model_dir: Path) -> str:
    raw = json.loads((model_dir / "config.json").read_text())
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    return "bfloat16" if dtype == "auto" else str(dtype)


def build_sim_runner(config) -> tuple[SimRunner, Path]:
    from model_zoo.builtin_models import resolve_model

    model_dir = resolve_model(config.model)
    runner = SimRunner(
        model_dir, load_profile(config.sim_profile),
        dtype=config.dtype.value if config.dtype else checkpoint_dtype(model_dir),
        num_devices=config.sim_num_devices,
        block_size=config.block_size,
        num_blocks=config.num_gpu_blocks_override,
        memory_utilization=config.gpu_memory_utilization,
        swap_space_bytes=config.swap_space * 2**30,
        offload_space_bytes=config.kv_offloading_size * 2**30,
        max_model_len=config.max_model_len,
        seed=config.seed,
        eos_probability=config.sim_eos_probability,
        speculative_config=parse_speculative_config(config.speculative_config),
        acceptance_rate=config.sim_acceptance_rate,
        kv_link=load_link_profile(config.sim_kv_link),
    )
    return runner, model_dir
