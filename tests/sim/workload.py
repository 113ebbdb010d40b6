"""A mixed workload for the sim tests: shared prefixes, EOS, stop ids, min_tokens, seeds."""

from __future__ import annotations

import random

from stepahead.plan import SamplingParams


def mixed_workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, vocab) for _ in range(48)] for _ in range(3)]
    out = []
    for i in range(n):
        tail = [rng.randrange(5, vocab) for _ in range(rng.randint(1, 40))]
        prompt = prefixes[i % 3] + tail if i % 2 else tail
        sampling = SamplingParams(
            temperature=0.0 if i % 4 else 1.0, seed=i if i % 5 == 0 else None,
            max_tokens=rng.randint(8, 48), min_tokens=4 if i % 7 == 0 else 0,
            stop_token_ids=(rng.randrange(5, vocab),) if i % 6 == 0 else (), ignore_eos=i % 9 == 0,
        )
        out.append((prompt, sampling))
    return out
