"""The commit side of the scheduler core: a result's tokens applied to the requests of its
plan (counters, committed output, stop rules, the prefix cache), and the step's events.

`Scheduler.update_from_output` checks the result against its plan and hands it here. The
plan's general entries (prefill chunks, new and resumed requests, speculating decodes) are
committed one by one; its decodes in bulk (`decodes.commit_decodes`), each that needs its own
look (a stop, a filled block, an event that is not plain) by the per-request rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.decodes import DecodeRun, commit_decodes
from scheduler_service.core.events import RequestEvent, StepEvents
from scheduler_service.core.kv_manager import KVCacheManager
from scheduler_service.core.logprob_events import add_committed, take_prompt_logprobs
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.speculation import settle
from scheduler_service.core.step_builder import InFlightPlan
from scheduler_service.core.token_rules import commit_one, commit_run, stop_reason
from stepahead.plan import StepResult


class StepCommitter:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, finish: Callable[[Request, FinishReason], None],
                 requests: Mapping[str, Request], hand_off: Callable[[Request], None]) -> None:
        """`finish`, `hand_off`: the core's status transitions (a request that ends; one that
        leaves a prefill core at `Request.handoff_at`); `requests`: its live requests by id."""
        self.config, self._kv, self._finish, self._requests = config, kv, finish, requests
        self._hand_off = hand_off
        self._eos = frozenset(config.eos_token_ids)

    def commit(self, record: InFlightPlan, result: StepResult, ordered: list[int] | None) -> StepEvents:
        """Commit `result` for its (checked) in-flight plan; `ordered`: its tokens in the plan's
        sampling order when it lists them so (`result_checks.check_result`)."""
        out, sampled, decoded = StepEvents(), result.sampled_token_ids, None
        if ordered is not None:  # in the plan's order: the decodes' tokens are the tail, no id to look up
            head = len(ordered) - (len(record.decodes.request_ids) if record.decodes is not None else 0)
            sampled, decoded = dict(zip(record.sampling[:head], ordered[:head])), ordered[head:]
        for entry in record.entries:
            self._commit_entry(entry, result, sampled, out)
        if record.decodes is not None:
            self._commit_decodes(record.decodes, result, decoded, out)
        return out

    def _commit_entry(self, entry, result: StepResult, sampled: Mapping[str, int], out: StepEvents) -> None:
        req, epoch, num_tokens, samples, drafts = entry
        if req.epoch != epoch:
            return  # preempted, finished or aborted since the plan was built: stale
        if result.failed and req.request_id in result.failed:
            self._fail(req, result, out)
            return
        cfg = self.config
        prompt_lp = take_prompt_logprobs(req, result) if result.prompt_logprobs else None
        if not samples:
            req.num_computed_tokens += num_tokens
        elif drafts:
            committed, reason = commit_run(cfg, self._eos, req, settle(req, num_tokens, drafts, result))
        else:
            req.num_computed_tokens += num_tokens
            req.num_output_placeholders -= 1
            token = sampled[req.request_id]
            committed, reason = (token,), commit_one(cfg, self._eos, req, token)
        bs = cfg.block_size
        if cfg.enable_prefix_caching and req.num_computed_tokens >= (len(req.prefix_ids) + 1) * bs <= req.num_tokens:
            self._kv.register_computed(req)
        if samples:
            if reason is not None:
                self._finish(req, reason)
            elif req.num_tokens >= req.handoff_at:
                self._hand_off(req)
            add_committed(out, req, committed, reason, result, prompt_lp, drafts)
        elif prompt_lp is not None:
            out.events.append(RequestEvent(req.request_id, (), None, req.num_prompt_tokens, 0,
                                           prompt_logprobs=prompt_lp))

    def _commit_decodes(self, run: DecodeRun, result: StepResult, tokens: list[int] | None, out: StepEvents) -> None:
        """`_commit_entry` of a run of decodes, in bulk (`decodes.commit_decodes`); each
        request that needs its own look (a stop, a filled block, an event that is not plain)
        gets it here."""
        if result.failed:  # each fails alone (finished: its row is stale for the commit below)
            for rid in result.failed.keys() & set(run.fresh_ids()):
                self._fail(self._requests[rid], result, out)
        done = commit_decodes(run, result, tokens, self._eos, self.config.enable_prefix_caching)
        for req in done.registrations:
            self._kv.register_computed(req)
        out.plain.request_ids += done.plain_ids
        out.plain.token_ids += done.plain_tokens
        for req, token, may_stop in done.special:
            prompt_lp = take_prompt_logprobs(req, result) if result.prompt_logprobs else None
            reason = stop_reason(self.config, self._eos, req, token) if may_stop else None
            if reason is not None:
                self._finish(req, reason)
            elif req.num_tokens >= req.handoff_at:
                self._hand_off(req)
            add_committed(out, req, (token,), reason, result, prompt_lp, 0)

    def _fail(self, req: Request, result: StepResult, out: StepEvents) -> None:
        rid = req.request_id
        self._finish(req, FinishReason.ERROR)
        out.events.append(RequestEvent(rid, (), FinishReason.ERROR, req.num_prompt_tokens, req.num_cached_tokens,
                                       f"worker: {result.failed[rid]}", rejected=rid in result.invalid_ids))
