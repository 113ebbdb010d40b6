"""The real scheduler core and the real ModelRunner in one process, with the in-flight window.

The worker executes plans strictly in order, but a plan's result is committed only after
the scheduler planned as far ahead as `max_concurrent_batches` allows, exactly as the
daemons do: in async mode step t+1 is planned (with placeholders) before step t's
tokens are known. `check_integrity()` runs after every commit.

With `config.prepare_grammars` the runner compiles a plan's grammars on its background
thread and reports each (`GrammarReady`); the engine hands the reports to the core before
each step, and waits for one when nothing else can run.
"""

from __future__ import annotations

import collections
import queue
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
        self.grammar_reports: queue.SimpleQueue = queue.SimpleQueue()  # the runner's GrammarReady reports
        if config.prepare_grammars:
            runner.grammar_report = self.grammar_reports.put

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
        self._record(events)
        return events

    def take_grammar_reports(self, wait: bool = False) -> None:
        """Hand the runner's grammar reports to the core (`wait`: for at least one, up to 60 s)."""
        while True:
            try:
                ready = self.grammar_reports.get(wait, timeout=60)
            except queue.Empty:
                if wait:
                    raise AssertionError("no grammar report within 60 s") from None
                return
            wait = False
            event = self.scheduler.grammar_ready(ready)
            self.scheduler.check_integrity()
            if event is not None:
                self._record([event])

    def _record(self, events: list[RequestEvent]) -> None:
        for e in events:
            self.outputs[e.request_id] += e.new_token_ids
            self.logprobs[e.request_id] += e.logprobs
            if e.prompt_logprobs is not None:
                self.prompt_logprobs[e.request_id].append(e.prompt_logprobs)
            if e.finish_reason is not None:
                self.finish[e.request_id] = e.finish_reason

    def step(self) -> list[RequestEvent]:
        self.take_grammar_reports()
        self.plan_ahead()
        if self.pending:
            return self.commit_oldest()
        if self.scheduler.num_preparing:  # nothing can run before a grammar is reported
            self.take_grammar_reports(wait=True)
        return []

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
