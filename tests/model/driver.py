"""A tiny test-only scheduler that drives a ModelRunner with StepPlans.

Allocates blocks from a free list, chunks prompts (`chunk` tokens per request per step),
admits requests at given steps (joining) and finishes them after `max_new` tokens (leaving),
under a per-step token budget, so prefill chunks interleave with other requests' decodes.
Every other step marks decodes as placeholder inputs (the device-side gather path).
With `preempt_every=k`, every k-th step preempts the newest running request, alternating
swap (KV copied to the host pool, resumed later with its computed count) and recompute
(KV dropped, resent later as prompt + output from scratch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stepahead.plan import NewRequest, RunningRequest, SamplingParams, StepPlan

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30)


@dataclass
class DriverStats:
    mixed_steps: int = 0  # steps with a prompt chunk and a decode together
    swaps: int = 0
    recomputes: int = 0
    placeholder_decodes: int = 0
    max_running_seen: int = 0


@dataclass
class ToyRequest:
    request_id: str
    prompt: list[int]
    max_new: int
    arrival_step: int = 0
    sampling: SamplingParams = GREEDY
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False
    sampled_last_step: bool = False
    host_blocks: list[int] = field(default_factory=list)
    preempted_at: int = -1

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new


class ToyScheduler:
    def __init__(self, runner, *, chunk: int = 32, token_budget: int = 96, max_running: int = 16,
                 preempt_every: int = 0):
        self.runner, self.chunk, self.budget, self.max_running = runner, chunk, token_budget, max_running
        self.preempt_every = preempt_every
        self.free_blocks = list(range(runner.num_blocks))
        self.free_host_blocks = list(range(runner.num_host_blocks))
        self.swapped: list[ToyRequest] = []
        self._preempted: list[str] = []
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self.waiting: list[ToyRequest] = []
        self.running: list[ToyRequest] = []
        self.finished: list[ToyRequest] = []
        self.step_id = 0
        self._to_forget: list[str] = []
        self.stats = DriverStats()

    def add(self, req: ToyRequest) -> None:
        self.waiting.append(req)

    def run(self, max_steps: int = 10_000) -> None:
        while self.waiting or self.running or self.swapped:
            self.step()
            if self.step_id > max_steps:
                raise RuntimeError("driver did not finish")
        if self._to_forget:  # a last, empty plan tells the worker to forget the finished ones
            self.step()

    def step(self):
        plan, scheduled = self._build_plan()
        result = self.runner.execute(plan)
        assert result.step_id == plan.step_id
        self._apply(scheduled, result.sampled_token_ids)
        self.step_id += 1
        return plan, result

    def _preempt(self) -> None:
        victims = [r for r in self.running if r.sent]
        if not (self.preempt_every and self.step_id % self.preempt_every == 0 and victims):
            return
        r = victims[-1]
        self.running.remove(r)
        self._preempted.append(r.request_id)
        r.sent, r.sampled_last_step, r.preempted_at = False, False, self.step_id
        if (self.stats.swaps + self.stats.recomputes) % 2 == 0:
            r.host_blocks = [self.free_host_blocks.pop() for _ in r.blocks]
            self._swap_out.extend(zip(r.blocks, r.host_blocks))
            self.swapped.append(r)
            self.stats.swaps += 1
        else:
            r.num_computed = 0
            self.waiting.insert(0, r)
            self.stats.recomputes += 1
        self.free_blocks.extend(r.blocks)
        r.blocks = []

    def _resume_swapped(self) -> None:
        for r in [r for r in self.swapped if r.preempted_at < self.step_id]:
            if len(self.running) >= self.max_running:
                return
            self.swapped.remove(r)
            r.blocks = [self.free_blocks.pop() for _ in r.host_blocks]
            self._swap_in.extend(zip(r.host_blocks, r.blocks))
            self.free_host_blocks.extend(r.host_blocks)
            r.host_blocks = []
            self.running.append(r)

    def _admit(self) -> None:
        self._preempt()
        self._resume_swapped()
        arrived = [r for r in self.waiting if r.arrival_step <= self.step_id]
        for r in arrived[: self.max_running - len(self.running)]:
            self.waiting.remove(r)
            self.running.append(r)

    def _build_plan(self):
        self._admit()
        new, running, scheduled, budget = [], [], [], self.budget
        for r in self.running:
            n = min(len(r.tokens) - r.num_computed, self.chunk, budget)
            if n <= 0:
                continue
            budget -= n
            fresh = self._grow(r, r.num_computed + n)
            scheduled.append((r, n))
            if not r.sent:
                new.append(NewRequest(r.request_id, tuple(r.tokens), r.sampling, tuple(r.blocks),
                                      r.num_computed, n, len(r.prompt)))
                r.sent = True
            else:
                placeholder = n == 1 and r.sampled_last_step and self.step_id % 2 == 1
                running.append(RunningRequest(r.request_id, tuple(fresh), n, placeholder))
        plan = StepPlan(self.step_id, tuple(new), tuple(running), finished_ids=tuple(self._to_forget),
                        preempted_ids=tuple(self._preempted), swap_out=tuple(self._swap_out),
                        swap_in=tuple(self._swap_in))
        self._to_forget, self._preempted, self._swap_out, self._swap_in = [], [], [], []
        self._record(plan, scheduled)
        return plan, scheduled

    def _record(self, plan: StepPlan, scheduled) -> None:
        sizes = {n for _, n in scheduled}
        self.stats.mixed_steps += 1 in sizes and any(n > 1 for n in sizes)
        self.stats.placeholder_decodes += sum(r.input_is_placeholder for r in plan.running)
        self.stats.max_running_seen = max(self.stats.max_running_seen, len(self.running))

    def _grow(self, r: ToyRequest, num_tokens: int) -> list[int]:
        need = -(-num_tokens // self.runner.block_size) - len(r.blocks)
        fresh = [self.free_blocks.pop() for _ in range(max(need, 0))]
        r.blocks.extend(fresh)
        return fresh

    def _apply(self, scheduled, sampled: dict[str, int]) -> None:
        for r, n in scheduled:
            r.num_computed += n
            r.sampled_last_step = r.request_id in sampled
            if r.sampled_last_step:
                assert r.num_computed == len(r.tokens)
                r.output.append(sampled[r.request_id])
            else:
                assert r.num_computed < len(r.tokens)
        for r in [r for r in self.running if r.done]:
            self.running.remove(r)
            self.finished.append(r)
            self.free_blocks.extend(r.blocks)
            self._to_forget.append(r.request_id)


def generate_staggered(runner, prompts: list[list[int]], max_new: int, *, chunk: int, token_budget: int = 48,
                       max_running: int = 4) -> ToyScheduler:
    """Greedy generations of `prompts` (`max_new` tokens each, request i arriving at step 2i), prompt
    chunks of `chunk` tokens beside other requests' decodes; returns the scheduler that ran them."""
    sched = ToyScheduler(runner, chunk=chunk, token_budget=token_budget, max_running=max_running)
    for i, p in enumerate(prompts):
        sched.add(ToyRequest(f"r{i}", p, max_new, arrival_step=2 * i))
    sched.run()
    return sched
