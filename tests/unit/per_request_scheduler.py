"""The lockstep oracle of the scheduler core's bulk decode path: a core whose every decode is
decided by `token_rules.num_new_tokens` and committed by `commit_one`, the prefix-cache check
and `add_committed`, one request at a time (the path a speculating core takes)."""

from __future__ import annotations

from scheduler_service.core.scheduler import Scheduler


class PerRequestScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._bulk = False  # no plain decode goes through `decodes.py`
