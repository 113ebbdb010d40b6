"""The chaos soak, one minute of it (`benchmarks/soak.py` runs ten): sim workers and
gateways as separate daemons, clients that abort or read slowly, a worker or a gateway
SIGKILLed and restarted every 15 s. No client that stayed loses anything, no token is wrong
or doubled, no block leaks, no process is orphaned, threads and fds stay bounded."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_minute_soak_loses_nothing(tmp_path, sim_model_dir):
    result = load_soak().soak(duration_s=60, streams=24, workers=2, gateways=2, kill_every_s=15, workdir=tmp_path,
                              model_dir=sim_model_dir)
    assert result["kills"], "nothing was killed"
    assert result["completed"] > 100, result
    assert result["lost"] == 0 and result["tokens_wrong_or_duplicated"] == 0, result["failures"]
    assert result["blocks_leaked"] == 0 and result["orphans"] == 0, result
    start, end = result["usage_start"], result["usage_end"]
    for name in ("scheduler",):
        assert end[name]["threads"] <= start[name]["threads"] + 40, (start[name], end[name])
        assert end[name]["fds"] <= start[name]["fds"] + 40, (start[name], end[name])
