"""The chaos soak, 25 s of it by default, one minute with `--slow` (`benchmarks/soak.py`
runs ten): sim workers and gateways as separate daemons, clients that abort or read
slowly, a worker or a gateway SIGKILLed and restarted every 4 s (15 s with `--slow`; the
last 10 s stay calm either way). No client that stayed loses anything, no token is wrong
or doubled, no block leaks, no process is orphaned, threads and fds stay bounded."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("duration_s, kill_every_s, min_completed", [
    (25, 4, 20), pytest.param(60, 15, 100, marks=pytest.mark.slow),
], ids=["25s", "60s"])
def test_soak_loses_nothing(tmp_path, sim_model_dir, duration_s, kill_every_s, min_completed):
    result = load_soak().soak(duration_s=duration_s, streams=24, workers=2, gateways=2, kill_every_s=kill_every_s,
                              workdir=tmp_path, model_dir=sim_model_dir)
    assert len(result["kills"]) >= 2, "too little was killed"
    assert result["completed"] > min_completed, result
    assert result["lost"] == 0 and result["tokens_wrong_or_duplicated"] == 0, result["failures"]
    assert result["blocks_leaked"] == 0 and result["orphans"] == 0, result
    start, end = result["usage_start"], result["usage_end"]
    for name in ("scheduler",):
        assert end[name]["threads"] <= start[name]["threads"] + 40, (start[name], end[name])
        assert end[name]["fds"] <= start[name]["fds"] + 40, (start[name], end[name])
