"""The per-request token rules of the scheduler core, as pure functions: how many tokens a
request computes in a step (chunking, the budget, never past `max_tokens` /
`max_model_len`), and whether a committed token ends it (EOS, stop ids, lengths)."""

from __future__ import annotations

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import NEVER, FinishReason, Request


def token_limit(req: Request, max_model_len: int) -> int:
    """The length rule, once: the known tokens a request may reach (its prompt plus
    `max_tokens`, never past `max_model_len`). A committed token that reaches it ends the
    request; the running set's columns hold it for the bulk decode path (`decodes.py`)."""
    return min(req.num_prompt_tokens + req.sampling.max_tokens, max_model_len)


def schedule_limit(req: Request, max_model_len: int) -> int:
    """The known tokens a request may be scheduled to reach on its core: the length rule, or
    sooner on a prefill replica (`Request.handoff_at`: it leaves with its first token)."""
    return min(token_limit(req, max_model_len), req.handoff_at)


def may_stop_at(req: Request, max_model_len: int) -> int:
    """`num_tokens` from which a committed token may end the request, EOS aside: its length
    limit, or 0 when it has stop ids or leaves its core at a hand-off (then each token is
    looked at). Below it, only an EOS id can end it, so `stop_reason` need not run (the
    running set's `stop_at` column holds it for the bulk path)."""
    if req.sampling.stop_token_ids or req.handoff_at != NEVER:  # each token is looked at (a hand-off too)
        return 0
    return token_limit(req, max_model_len)


def placeholder_input(start, num_tokens):
    """Whether a decode's input, the token at position `start`, is a placeholder: sampled by
    a plan still in flight, not committed yet. Scalars, or numpy columns (`decodes.py`)."""
    return start >= num_tokens


def waits_for_older_plan(num_output_placeholders, last_step_id, prev_step_id):
    """Whether a running request's decode must wait: its pending token was sampled by a plan
    older than the previous one, and the worker reads placeholders only from the previous
    step's sampled ids (with 3+ plans in flight, a request left out of the previous plan;
    never with two). Scalars, or numpy columns (`decodes.py`)."""
    return (num_output_placeholders != 0) & (last_step_id != prev_step_id)


def num_new_tokens(cfg: SchedulerConfig, req: Request, remaining: int, tokens_left: int,
                   prev_step_id: int | None = None) -> int:
    """Tokens to compute this step (0: none), honouring chunking and max_tokens.
    `remaining`: tokens not scheduled yet (placeholders included); `tokens_left`: the budget.
    `prev_step_id` (a running request's: the plan before this one): `waits_for_older_plan`."""
    if remaining <= 0 or tokens_left <= 0:
        return 0
    if prev_step_id is not None and waits_for_older_plan(req.num_output_placeholders, req.last_step_id, prev_step_id):
        return 0
    if remaining == 1:  # a decode: the common case
        n = 1
    elif not cfg.enable_chunked_prefill:
        n = remaining if remaining <= tokens_left else 0
    else:
        n = min(remaining, tokens_left)
        if cfg.long_prefill_token_threshold:
            n = min(n, cfg.long_prefill_token_threshold)
    if n == remaining:  # the step samples: never past max_tokens / max_model_len
        if req.num_tokens + req.num_output_placeholders >= schedule_limit(req, cfg.max_model_len):
            return 0  # its pending placeholders may already complete it
    return n


def stop_reason(cfg: SchedulerConfig, eos: frozenset[int], req: Request, token: int) -> FinishReason | None:
    """Why `req` ends with its newly committed `token`, or None when it goes on."""
    sp, num_output = req.sampling, len(req.output_token_ids)
    if num_output >= sp.min_tokens:
        if (token in eos and not sp.ignore_eos) or token in sp.stop_token_ids:
            return FinishReason.STOP
    if req.num_tokens >= token_limit(req, cfg.max_model_len):
        return FinishReason.LENGTH
    return None


def commit_run(cfg: SchedulerConfig, eos: frozenset[int], req: Request,
               new: tuple[int, ...]) -> tuple[tuple[int, ...], FinishReason | None]:
    """Commit a step's tokens in order, up to the first that finishes the request."""
    for i, token in enumerate(new):
        req.commit_token(token)
        reason = stop_reason(cfg, eos, req, token)
        if reason is not None:
            return new[: i + 1], reason
    return new, None


def commit_one(cfg: SchedulerConfig, eos: frozenset[int], req: Request, token: int) -> FinishReason | None:
    """`commit_run` of one sampled token (a plain decode: the hot path, so `stop_reason` runs
    only when this token or a length limit could end the request)."""
    req.commit_token(token)
    if token in eos or req.num_tokens >= may_stop_at(req, cfg.max_model_len):
        return stop_reason(cfg, eos, req, token)
    return None
