"""OpenAI's two logprobs shapes, built from the gateway's `TokenLogprob`s (pure domain code).

Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (parallel lists;
with `echo` the prompt's entries come first, the first one with a null logprob and null
top; each `top_logprobs` entry maps token text to logprob: the top k plus the token itself,
so `logprobs=0` gives the sampled token alone). Chat: `{"content": [{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`, `bytes` the token's own bytes.
JSON has no -infinity: a logprob of -inf (a token the model rules out entirely) is sent as
-9999.0, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from gateway.logprob_output import TokenLogprob

NEG_INF_LOGPROB = -9999.0


def _num(value: float) -> float:
    return NEG_INF_LOGPROB if value == -math.inf else value


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> dict:
    """`entries` as one completions `logprobs` object; `offset` is added to text offsets."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        out["tokens"].append(e.token)
        out["text_offset"].append(offset + e.offset)
        if e.logprob is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_num(e.logprob))
        top = {t.text: _num(t.logprob) for t in e.top}
        top.setdefault(e.token, _num(e.logprob))
        out["top_logprobs"].append(top)
    return out


def align_to_text(entries: Sequence[TokenLogprob], text: str) -> list[TokenLogprob]:
    """The prompt's entries as shares of the echoed `text`: a token whose piece is not in the
    text where it would start (a special token the tokenizer added, such as BOS, which the
    prompt string does not contain) gets `""` there, so the tokens still concatenate to the
    text and every `text_offset` indexes it. When the pieces do not spell the text at all
    (the tokenizer normalized it), the entries are left as they are."""
    out, cursor = [], 0
    for e in entries:
        if text.startswith(e.token, cursor):
            out.append(dataclasses.replace(e, offset=cursor))
            cursor += len(e.token)
        else:
            out.append(dataclasses.replace(e, token="", offset=cursor))
    return out if cursor == len(text) else list(entries)


def merge_completion_logprobs(parts: Sequence[dict]) -> dict:
    return {key: [x for part in parts for x in part[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                     "text_offset")}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> list[dict]:
    """`entries` as chat `logprobs.content` items. `bytes` is what the token stands for, also
    part of a character (OpenAI's use: the bytes of consecutive tokens join into the text),
    where `token` is its piece of the returned text."""
    return [
        {"token": e.token, "logprob": _num(e.logprob), "bytes": list(e.token_bytes),
         "top_logprobs": [{"token": t.text, "logprob": _num(t.logprob), "bytes": list(t.token_bytes)}
                          for t in e.top]}
        for e in entries
    ]
