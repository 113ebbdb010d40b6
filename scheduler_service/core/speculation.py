"""The scheduler's side of n-gram speculative decoding (docs/speculative-decoding.md).

The scheduler never sees drafts: the worker proposes them. It decides how many a decode
*may* verify (`draft_allowance`: K, cut by the token budget, max_tokens and
max_model_len, counting in-flight steps at their worst case), budgets and reserves 1 + k
tokens for it, counts 1 + k output placeholders until the result arrives, and then
commits what was accepted and rolls the rest back (`settle`).
"""

from __future__ import annotations

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request
from stepahead.plan import StepResult


def draft_allowance(config: SchedulerConfig, req: Request, token_budget: int) -> int:
    """Drafts a one-token decode of `req` may verify this step (0: a plain decode).

    Worst case: every in-flight step of the request accepts all its drafts, so the
    output placeholders count 1 + k each and this step may add 1 + k more tokens.
    """
    k = config.num_speculative_tokens
    if not k:
        return 0
    pending = req.num_output_placeholders
    room_output = req.sampling.max_tokens - len(req.output_token_ids) - pending - 1
    room_length = config.max_model_len - req.num_tokens - pending - 1
    return max(0, min(k, token_budget - 1, room_output, room_length))


def settle(req: Request, num_tokens: int, num_drafts: int, result: StepResult) -> tuple[int, ...]:
    """Apply a fresh sampling entry's result to `req`'s counters; returns the tokens it
    produced (accepted drafts + sampled token), not yet committed.

    The step computed 1 + accepted of its 1 + num_drafts budgeted positions: the rest is
    rolled back from `num_scheduled_tokens` (later in-flight steps shift down with it, as
    the worker placed them), and all 1 + num_drafts placeholders are settled.
    """
    new = result.new_token_ids(req.request_id)
    rollback = 1 + num_drafts - len(new)
    req.num_computed_tokens += num_tokens - rollback
    req.num_scheduled_tokens -= rollback
    req.num_output_placeholders -= 1 + num_drafts
    outcome = result.speculation.get(req.request_id)
    if outcome is not None:
        req.num_draft_tokens += outcome.num_draft_tokens
        req.num_accepted_tokens += len(outcome.accepted_token_ids)
        req.num_spec_steps += outcome.num_draft_tokens > 0
    return new
