"""The real scheduler core and the real ModelRunner in one process, with the in-flight window.

The worker executes plans strictly in order, but a plan's result is committed only after
the scheduler planned as far ahead as `max_concurrent_batches` allows, exactly as the
daemons do: in async mode step t+1 is planned (with placeholders) before step t's
tokens are known. `check_integrity()` runs after every commit.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import RequestEvent, Scheduler
from scheduler_service.step_loop import StepLoop
from stepahead.plan import StepPlan


class LocalEngine:
    def __init__(self, runner, config: SchedulerConfig) -> None:
        self.runner = runner
        self.scheduler = Scheduler(config)
        self.loop = StepLoop(self.scheduler)
        self.plans: list[StepPlan] = []  # every plan, in order
        self.outputs: dict[str, list[int]] = collections.defaultdict(list)
        self.finish: dict[str, object] = {}
        self.logprobs: dict[str, list] = collections.defaultdict(list)  # per request: Logprobs per token
        self.prompt_logprobs: dict[str, list] = collections.defaultdict(list)  # per request: PromptLogprobs parts

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)

    @property
    def pending(self) -> int:
        return self.loop.num_in_flight

    def plan_ahead(self) -> None:
        self.plans += self.loop.plan_ahead()

    def commit_oldest(self) -> list[RequestEvent]:
        _, events = self.loop.commit(self.runner.execute(self.loop.oldest))
        self.scheduler.check_integrity()
        for e in events:
            self.outputs[e.request_id] += e.new_token_ids
            self.logprobs[e.request_id] += e.logprobs
            if e.prompt_logprobs is not None:
                self.prompt_logprobs[e.request_id].append(e.prompt_logprobs)
            if e.finish_reason is not None:
                self.finish[e.request_id] = e.finish_reason
        return events

    def step(self) -> list[RequestEvent]:
        self.plan_ahead()
        return self.commit_oldest() if self.pending else []

    def run(self, before_step: Callable[[int], None] = lambda i: None, max_steps: int = 10_000) -> None:
        for i in range(max_steps):
            before_step(i)
            if not self.scheduler.has_unfinished_requests() and not self.pending:
                return
            self.step()
        raise AssertionError("requests did not finish")

    def assert_no_leaks(self) -> None:
        while self.pending:  # results of plans still in flight release their fences
            self.commit_oldest()
        stats = self.scheduler.stats()
        assert stats.num_free_blocks == stats.num_total_blocks, stats
        assert stats.num_fenced_blocks == 0 and stats.num_used_host_blocks == 0, stats
