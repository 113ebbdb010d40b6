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
from operator import attrgetter

import numpy as np

from stepahead.plan import SamplingParams

MASK64 = (1 << 64) - 1
_UNIT53 = 1.0 / (1 << 53)
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
        object.__setattr__(self, "_eos", frozenset(self.eos_token_ids))  # not a field: derived

    def seed_of(self, sampling: SamplingParams) -> int:
        return self.default_seed if sampling.seed is None else sampling.seed

    def next_token(self, h: int, position: int, num_output: int, sampling: SamplingParams) -> int:
        """The token at `position` (`num_output` outputs so far) after history hash `h`
        (`reference_next_token` is the same function spelled plainly, the tests' oracle; this one
        keeps its banned sets precomputed)."""
        k = mix(h ^ ((position * GOLDEN) & MASK64))
        masked = num_output < sampling.min_tokens
        eos = self.eos_token_ids
        if eos and (not masked or sampling.ignore_eos) and (k >> 11) * _UNIT53 < self.eos_probability:
            return eos[0]
        banned = self._banned(sampling) if masked else self._eos
        while True:
            k = mix((k + GOLDEN) & MASK64)
            token = k % self.vocab_size
            if token not in banned:
                return token

    def advance_many(self, hashes: list[int], positions: list[int], num_outputs: list[int],
                     samplings: list[SamplingParams]) -> tuple[list[int], list[int]]:
        """(tokens, history hashes after them) of many rows: `next_token` and `extend` of each.

        Vectorised over the rows in uint64 arithmetic (which wraps mod 2**64, as the
        `& MASK64` of the scalar code does); the rows the array pass cannot finish (EOS still
        masked, an EOS draw, a token that needs a re-draw) are re-done by `next_token`."""
        n = len(hashes)
        if n < _MIN_VECTOR_ROWS:
            out = [self.next_token(*row) for row in zip(hashes, positions, num_outputs, samplings)]
            return out, [extend(h, (t,)) for h, t in zip(hashes, out)]
        h = np.array(hashes, dtype=np.uint64)
        k = _mix_array(h ^ (np.array(positions, dtype=np.uint64) * _GOLDEN))
        drawn = _mix_array(k + _GOLDEN) % np.uint64(self.vocab_size)
        redo = np.zeros(n, dtype=bool)
        for eos in self._eos:  # a drawn EOS id is re-drawn (np.isin costs more for a few ids)
            redo |= drawn == np.uint64(eos)
        if self._eos and self.eos_probability > 0.0:
            redo |= (k >> _S11).astype(np.float64) * _UNIT53 < self.eos_probability
        out = drawn.tolist()
        redo_rows = set(np.flatnonzero(redo).tolist())
        if max(map(_MIN_TOKENS, samplings)) > 0:  # rows whose EOS / stop ids are still masked
            redo_rows.update(i for i, (o, s) in enumerate(zip(num_outputs, samplings)) if o < s.min_tokens)
        for i in redo_rows:
            out[i] = self.next_token(hashes[i], positions[i], num_outputs[i], samplings[i])
        if redo_rows:
            drawn = np.array(out, dtype=np.uint64)
        return out, ((h ^ drawn) * _FNV_PRIME).tolist()

    def _banned(self, sampling: SamplingParams) -> frozenset[int]:
        return self._eos | frozenset(sampling.stop_token_ids)


_MIN_VECTOR_ROWS = 16  # below this, numpy's per-call overhead costs more than the rows
_GOLDEN, _FNV_PRIME = np.uint64(GOLDEN), np.uint64(FNV_PRIME)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
_MIN_TOKENS = attrgetter("min_tokens")
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix_array(x: np.ndarray) -> np.ndarray:
    """`mix` of every element of a uint64 array (products wrap mod 2**64)."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


def reference_next_token(rule: TokenRule, h: int, position: int, num_output: int, sampling: SamplingParams) -> int:
    """`TokenRule.next_token` written plainly (the definition in this module's docstring)."""
    k = mix(h ^ ((position * GOLDEN) & MASK64))
    masked = num_output < sampling.min_tokens
    if rule.eos_token_ids and (not masked or sampling.ignore_eos):
        if (k >> 11) * (1.0 / (1 << 53)) < rule.eos_probability:
            return rule.eos_token_ids[0]
    banned = set(rule.eos_token_ids)
    if masked:
        banned.update(sampling.stop_token_ids)
    while True:
        k = mix((k + GOLDEN) & MASK64)
        token = k % rule.vocab_size
        if token not in banned:
            return token


def reference_output(rule: TokenRule, prompt: list[int], sampling: SamplingParams, max_model_len: int) -> list[int]:
    """The tokens a request gets from the sim worker, with the scheduler's stop rules."""
    h = extend(seed_hash(rule.seed_of(sampling)), prompt)
    out: list[int] = []
    eos = set(rule.eos_token_ids)
    while True:
        token = reference_next_token(rule, h, len(prompt) + len(out), len(out), sampling)
        out.append(token)
        h = extend(h, (token,))
        if len(out) >= sampling.min_tokens and (
                (token in eos and not sampling.ignore_eos) or token in sampling.stop_token_ids):
            return out
        if len(out) >= sampling.max_tokens or len(prompt) + len(out) >= max_model_len:
            return out
