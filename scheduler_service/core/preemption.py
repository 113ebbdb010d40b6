"""When a running request may be preempted, and which one (pure Python): the one place of the rule.

Two cases take a running request off the device:

- *Policy preemption*: a waiting candidate the policy ranks higher (`QueuePolicy.may_preempt`)
  takes the place of a running victim. It is chosen only when it pays, in device steps:

      cost(victim) = the steps the preemption throws away and the device must spend again:
                     the victim's computed tokens / max_num_batched_tokens (a step's token
                     budget recomputes them; under swap they are copied out and back instead,
                     priced the same: an upper bound)
      gain         = the steps the candidate would otherwise wait for a place: the fewest tokens
                     any running request has left to generate (a step gives each running request
                     one token; the first to finish frees its sequence slot and its blocks)

  and it pays when gain > cost. So a nearly finished victim is left to finish (its slot comes
  back in fewer steps than its recompute costs), and a victim holding a long prefill is not
  thrown away for a candidate that would get a slot within a few steps anyway.

- *Block shortage*: a running request needs a KV block and none is free; something must go
  (a forced preemption: no cost test, no protection). The worst-ranked running request goes
  (`Scheduler._reserve`; passing over protected ones there would remove a request from the
  middle of the running order, under the step's bulk decode masks, which index by position).

Protection (`preemption_min_progress`, tokens): a request preempted before is protected until
it has committed that many output tokens since its last preemption (or finishes): it is never
a policy preemption's victim (a block shortage may still take it). So a
request once preempted is not preempted again before it has made progress (no preempt / readmit
thrash: each preemption of a request buys it at least that many tokens). 0 turns protection off.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request


class PreemptionRule:
    def __init__(self, config: SchedulerConfig) -> None:
        self.min_progress = config.preemption_min_progress
        self.step_tokens = config.max_num_batched_tokens

    def protected(self, request: Request) -> bool:
        """Preempted before, and fewer than `min_progress` output tokens committed since."""
        return (self.min_progress > 0 and request.num_preemptions > 0
                and request.num_output_tokens - request.output_at_preemption < self.min_progress)

    def cost(self, victim: Request) -> float:
        """Device steps a preemption of `victim` throws away."""
        return victim.num_computed_tokens / self.step_tokens

    @staticmethod
    def gain(running: Iterable[Request]) -> int:
        """Steps a waiting request would otherwise wait for a running one to finish."""
        return min((r.sampling.max_tokens - r.num_output_tokens for r in running), default=0)

    def policy_victims(self, worst_first: Iterable[Request], gain: int) -> list[Request]:
        """Of the running requests (worst first), those a policy preemption may take: not
        protected, and cheaper to preempt than the candidate's `gain`."""
        return [v for v in worst_first if not self.protected(v) and self.cost(v) < gain]
