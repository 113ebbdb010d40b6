"""`--stream-interval N` (vLLM's flag) through the real daemons: the same tokens as the sim
reference, in messages of at least N tokens except a sequence's first and its last."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from stepahead.plan import SamplingParams
from tests.service.harness import Serve
from tests.sim.test_sim_e2e import to_proto
from worker_service.sim.profiles import load_profile
from worker_service.sim.runner import SimRunner
from worker_service.sim.tokens import reference_output

INTERVAL, SEED = 4, 5


def test_stream_interval_sends_fewer_larger_messages_with_the_same_tokens(sim_model_dir, fast_profile):
    rule = SimRunner(sim_model_dir, load_profile("h200"), num_blocks=64, eos_probability=0.0, seed=SEED).rule
    work = [([5 + i, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=23 + i, ignore_eos=True))
            for i in range(8)]
    with Serve(sim_model_dir, "--device", "sim", "--sim-profile", str(fast_profile), "--seed", str(SEED),
               "--sim-eos-probability", "0", "--stream-interval", str(INTERVAL)) as serve:
        with ThreadPoolExecutor(len(work)) as pool:
            replies = list(pool.map(lambda w: list(serve.gateway.Generate(to_proto(*w), timeout=120)), work))
    for (prompt, sampling), messages in zip(work, replies):
        sizes = [len(m.token_ids) for m in messages if m.token_ids]
        assert [t for m in messages for t in m.token_ids] == reference_output(rule, prompt, sampling, 1 << 20)
        # the first message is not held for the interval, but it carries every token that was
        # already queued when the gateway sent it (more than one on a loaded machine)
        assert all(n >= INTERVAL for n in sizes[1:-1]), sizes
        assert len(sizes) <= 2 + sampling.max_tokens // INTERVAL, sizes
