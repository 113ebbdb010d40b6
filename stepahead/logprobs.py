"""Log-probabilities as the worker returns them and the scheduler forwards them (pure Python).

All values are *raw* logprobs (vLLM's default `raw_logprobs` mode): the log-softmax of the
model's logits before logit bias, penalties, the min_tokens stop mask, temperature and
truncation, so they describe the model, not the sampling settings. A request asks with
`SamplingParams.logprobs` (k: the sampled token's logprob, plus the k most likely tokens;
0: the sampled token's only) and `SamplingParams.prompt_logprobs` (the same for every prompt
token after the first, given the tokens before it). Top-k lists are most likely first
(equal values in `torch.topk`'s order; the tests compare sets with the HF oracle's tie rule).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20  # default of --max-logprobs (vLLM's): the largest k a request may ask for


@dataclass(frozen=True)
class Logprobs:
    """One position: the token there (sampled, or the prompt's) and the most likely ones."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first

    def as_dict(self) -> dict[int, float]:
        """Token id -> logprob: the top-k plus the position's own token."""
        out = dict(self.top)
        out[self.token_id] = self.logprob
        return out


@dataclass(frozen=True)
class PromptLogprobs:
    """Prompt logprobs of one step's chunk: `entries[i]` is for prompt position `start + i`
    (start >= 1: the first prompt token has nothing before it)."""

    start: int
    entries: tuple[Logprobs, ...]

    @property
    def end(self) -> int:
        return self.start + len(self.entries)

    def after(self, position: int) -> PromptLogprobs | None:
        """The entries for positions >= `position` (None when there are none): what a
        recomputed chunk adds beyond what was already delivered."""
        skip = max(position - self.start, 0)
        if skip >= len(self.entries):
            return None
        return self if skip == 0 else PromptLogprobs(self.start + skip, self.entries[skip:])
