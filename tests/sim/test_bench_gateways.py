"""`stepahead bench --target A,B`: one client spreads its requests round-robin over gateways."""

from __future__ import annotations

import argparse

import pytest

from cli import bench
from tests.service.harness import Serve
from testing.processes import spawn_gateway


def test_requests_alternate_between_the_listed_gateways(sim_model_dir, fast_profile):
    """The second gateway wants an API key the client does not send, so exactly the requests
    routed to it (every other one) fail, and only those."""
    with Serve(sim_model_dir, "--device", "sim", "--sim-profile", str(fast_profile)) as serve:
        keyed, address = spawn_gateway(serve.scheduler_addr, str(sim_model_dir), serve.cluster_token,
                                       env={"STEPAHEAD_API_KEY": "only-for-b"})
        try:
            parser = argparse.ArgumentParser()
            bench.add_arguments(parser)
            args = parser.parse_args(["--target", f"{serve.gateway_addr},{address}", "--num-prompts", "6",
                                      "--random-input-len", "8", "--random-output-len", "3", "--ignore-eos",
                                      "--disable-tqdm"])
            summary = bench.bench(args)
        finally:
            keyed.terminate()
            keyed.wait(30)
    assert summary["completed"] == 3 and summary["failed"] == 3
    assert summary["total_output_tokens"] == 3 * 3
    assert all("UNAUTHENTICATED" in e for e in summary["errors"]), summary["errors"]


@pytest.mark.parametrize("target", ["a:1,,b:2", ",a:1"])
def test_an_empty_address_in_the_target_list_is_refused(target):
    with pytest.raises(SystemExit, match="--target"):
        bench.targets(target)
