"""`--speculative-config`: n-gram (prompt lookup) speculative decoding, vLLM's JSON format.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_min": 2, "prompt_lookup_max": 5}'

(also `STEPAHEAD_SPECULATIVE_CONFIG`). The scheduler reads `num_speculative_tokens` (K: it
budgets K+1 tokens and reserves KV blocks for them per speculating decode); the worker
reads the lookup window (it proposes up to min(its K, the plan's allowance) drafts and
verifies them). See docs/speculative-decoding.md. Pure Python: every daemon imports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from stepahead.config import ConfigError

MAX_SPECULATIVE_TOKENS = 32  # a sanity bound: K+1 tokens per decode are budgeted and reserved
_KEYS = frozenset({"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"})


class SpeculativeConfigError(ConfigError):
    """A --speculative-config that cannot be used; the message names the field."""


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int  # K: drafts verified per decode step at most
    prompt_lookup_min: int = 1  # shortest suffix n-gram looked up in the request's tokens
    prompt_lookup_max: int = 3  # longest one (tried first)
    method: str = "ngram"

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise SpeculativeConfigError(f"speculative config: method {self.method!r} is not supported (only 'ngram')")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpeculativeConfigError(f"speculative config: {name} must be an integer >= 1, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                f"speculative config: num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpeculativeConfigError(
                f"speculative config: prompt_lookup_min ({self.prompt_lookup_min}) > prompt_lookup_max "
                f"({self.prompt_lookup_max})")


def parse_speculative_config(raw: str | None) -> SpeculativeConfig | None:
    """The config from its JSON text; None for an empty value. Raises SpeculativeConfigError."""
    if raw is None or not raw.strip():
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SpeculativeConfigError(f"speculative config is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SpeculativeConfigError("speculative config must be a JSON object")
    unknown = set(data) - _KEYS
    if unknown:
        raise SpeculativeConfigError(f"speculative config: unknown field(s) {sorted(unknown)}; known: {sorted(_KEYS)}")
    if "method" not in data:
        raise SpeculativeConfigError("speculative config: 'method' is required (\"ngram\")")
    if "num_speculative_tokens" not in data:
        raise SpeculativeConfigError("speculative config: 'num_speculative_tokens' is required")
    lookup_max = data.get("prompt_lookup_max", data.get("prompt_lookup_min", 3))
    lookup_min = data.get("prompt_lookup_min", min(1, lookup_max) if isinstance(lookup_max, int) else 1)
    return SpeculativeConfig(data["num_speculative_tokens"], lookup_min, lookup_max, data["method"])


def num_speculative_tokens(raw: str | None) -> int:
    """K of a --speculative-config value (0: speculation off)."""
    config = parse_speculative_config(raw)
    return config.num_speculative_tokens if config else 0
