"""Deterministic tokens of the simulated worker, and the pure-Python reference.

A request's next token is a function of (seed, its whole token history, position) only:
the history enters through a 64-bit rolling hash that the runner extends by one word per
token, so a request that is preempted and recomputed, hits the prefix cache, or runs under
the async or the synchronous loop gets the very same tokens. The seed is the request's
sampling seed, else the worker's `--seed`.

Draw for position n with history hash h: k = mix(h ^ n*golden); with probability
`eos_probability` (k's top 53 bits as a uniform number) the token is the first EOS id,
unless EOS is masked (fewer than `min_tokens` outputs and not `ignore_eos`); otherwise a
token in [0, vocab) re-drawn while it is an EOS id, or a stop id before `min_tokens`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from stepahead.plan import SamplingParams

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
FNV_PRIME = 0x100000001B3


def mix(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit words with good avalanche."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def seed_hash(seed: int) -> int:
    return mix((seed * GOLDEN + 1) & MASK64)


def extend(h: int, tokens: Iterable[int]) -> int:
    """The rolling history hash after appending `tokens` (FNV-1a over token words)."""
    for t in tokens:
        h = ((h ^ t) * FNV_PRIME) & MASK64
    return h


@dataclass(frozen=True)
class TokenRule:
    vocab_size: int  # sampled ids stay below this (the tokenizer's vocabulary)
    eos_token_ids: tuple[int, ...]
    eos_probability: float
    default_seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.eos_probability <= 1.0:
            raise ValueError(f"sim eos probability must be in [0, 1], got {self.eos_probability}")
        if self.vocab_size <= len(set(self.eos_token_ids)) + 1:
            raise ValueError(f"sim vocabulary of {self.vocab_size} ids leaves nothing to sample")

    def seed_of(self, sampling: SamplingParams) -> int:
        return self.default_seed if sampling.seed is None else sampling.seed

    def next_token(self, h: int, position: int, num_output: int, sampling: SamplingParams) -> int:
        k = mix(h ^ ((position * GOLDEN) & MASK64))
        masked = num_output < sampling.min_tokens
        if self.eos_token_ids and (not masked or sampling.ignore_eos):
            if (k >> 11) * (1.0 / (1 << 53)) < self.eos_probability:
                return self.eos_token_ids[0]
        banned = set(self.eos_token_ids)
        if masked:
            banned.update(sampling.stop_token_ids)
        while True:
            k = mix((k + GOLDEN) & MASK64)
            token = k % self.vocab_size
            if token not in banned:
                return token


def reference_output(rule: TokenRule, prompt: list[int], sampling: SamplingParams, max_model_len: int) -> list[int]:
    """The tokens a request gets from the sim worker, with the scheduler's stop rules."""
    h = extend(seed_hash(rule.seed_of(sampling)), prompt)
    out: list[int] = []
    eos = set(rule.eos_token_ids)
    while True:
        token = rule.next_token(h, len(prompt) + len(out), len(out), sampling)
        out.append(token)
        h = extend(h, (token,))
        if len(out) >= sampling.min_tokens and (
                (token in eos and not sampling.ignore_eos) or token in sampling.stop_token_ids):
            return out
        if len(out) >= sampling.max_tokens or len(prompt) + len(out) >= max_model_len:
            return out
