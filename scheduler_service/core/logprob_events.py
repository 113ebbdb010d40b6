"""Logprobs on the scheduler, forwarded in events (pure Python; `result_checks` checks them
in a worker's result first); and the event of a request that committed tokens
(`add_committed`: a plain token when `is_plain_commit`, else `token_event`'s, which carries them).

Prompt logprobs are forwarded once per position: a request recomputed after preemption (or adopted by another replica) computes
its prompt again, and only positions past `Request.prompt_logprobs_end` go out. Once every
prompt position was delivered the request stops asking (a later recompute computes none),
and it may use the prefix cache again.
"""

from __future__ import annotations

import dataclasses

from scheduler_service.core.events import RequestEvent, StepEvents
from scheduler_service.core.request import FinishReason, Request
from stepahead.logprobs import Logprobs, PromptLogprobs
from stepahead.plan import StepResult


def take_prompt_logprobs(req: Request, result: StepResult) -> PromptLogprobs | None:
    """The prompt logprobs of `req` in `result` not delivered yet (None: nothing new)."""
    part = result.prompt_logprobs.get(req.request_id)
    if part is None:
        return None
    part = part.after(req.prompt_logprobs_end)
    if part is None or part.start != req.prompt_logprobs_end:
        return None  # nothing new, or a gap (never from a correct worker): wait for a complete pass
    req.prompt_logprobs_end = min(part.end, req.num_prompt_tokens)
    if req.prompt_logprobs_end >= req.num_prompt_tokens:
        req.sampling = dataclasses.replace(req.sampling, prompt_logprobs=None)
    return part


def logprobs_of(result: StepResult, request_id: str) -> tuple[Logprobs, ...]:
    """The new tokens' logprobs as an event carries them, one per token in order: the accepted
    drafts' (speculative decoding), then the sampled token's (empty when not asked)."""
    lp = result.logprobs.get(request_id) if result.logprobs else None
    if lp is None:
        return ()
    outcome = result.speculation.get(request_id)
    return (*outcome.accepted_logprobs, lp) if outcome is not None else (lp,)


NEVER_PLAIN = 2**63 - 1  # `plain_from` of a request whose tokens are never plain


def plain_from(req: Request) -> int:
    """`num_tokens` from which a request's committed tokens may be plain events: past its
    first output token, unless it asks for logprobs or has counted drafts (then never). The
    running set's `plain_from` column holds it for the bulk path (`decodes.commit_decodes`)."""
    if req.sampling.logprobs is None and not req.num_draft_tokens:
        return req.num_prompt_tokens + 2
    return NEVER_PLAIN


def is_plain_commit(req: Request, reason: FinishReason | None, result: StepResult,
                    prompt_lp: PromptLogprobs | None, drafts: int) -> bool:
    """The rule of a plain token: one committed token past `plain_from` that does not end
    the request, with no logprobs, prompt logprobs or drafts in this step
    (`decodes.commit_decodes` applies the same rule to a whole run of decodes at once)."""
    return (reason is None and prompt_lp is None and not drafts and req.request_id not in result.logprobs
            and req.num_tokens >= plain_from(req))


def add_committed(out: StepEvents, req: Request, committed: tuple[int, ...], reason: FinishReason | None,
                  result: StepResult, prompt_lp: PromptLogprobs | None, drafts: int) -> None:
    """The event of a request that committed `committed` in `result`'s step, into `out`: a
    plain token (`is_plain_commit`), else `token_event`'s."""
    if is_plain_commit(req, reason, result, prompt_lp, drafts):
        out.plain.add(req.request_id, committed[0])
    else:
        out.events.append(token_event(req, committed, reason, result if result.logprobs else None, prompt_lp))


def token_event(req: Request, committed: tuple[int, ...], reason: FinishReason | None,
                lp_result: StepResult | None, prompt_lp: PromptLogprobs | None) -> RequestEvent:
    """The event of a request that committed `committed` (its logprobs from `lp_result`, None
    when the step has none); the extras are set only where they apply: one event per running
    request per step."""
    first = len(req.output_token_ids) == len(committed)
    if not (first or lp_result or prompt_lp or req.num_draft_tokens):
        return RequestEvent(req.request_id, committed, reason, len(req.prompt_token_ids), req.num_cached_tokens)
    return RequestEvent(
        req.request_id, committed, reason, len(req.prompt_token_ids), req.num_cached_tokens,
        queue_time=req.queue_time if first else None,
        logprobs=logprobs_of(lp_result, req.request_id)[: len(committed)] if lp_result else (),
        prompt_logprobs=prompt_lp, num_draft_tokens=req.num_draft_tokens,
        num_accepted_tokens=req.num_accepted_tokens, num_spec_steps=req.num_spec_steps)
