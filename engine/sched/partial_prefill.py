"""The v0 scheduler's concurrent partial prefills, as an optional limiter.

Off unless ``max_num_partial_prefills > 1``. Then at most that many requests
are mid-prefill at once, at most ``max_long_partial_prefills`` of them long
(more than the long-prefill threshold of tokens left), and each prefill's
chunk is capped at an even share of the token budget. A long waiting prompt
that would exceed the long limit is skipped so shorter prompts behind it go
first.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from engine.config import SchedulerConfig
from engine.request import Request


class Admission(enum.Enum):
    ADMIT = "admit"
    SKIP = "skip"  # pass over this request; later ones may go
    STOP = "stop"  # no more prefills this step


def is_prefilling(request: Request) -> bool:
    """Still catching up with known tokens (more than one decode token)."""
    return request.num_computed_tokens < request.num_tokens - 1


class PartialPrefillLimiter:
    def __init__(self, config: SchedulerConfig) -> None:
        self.max_prefills = config.max_num_partial_prefills
        self.max_long = config.max_long_partial_prefills
        self.threshold = config.effective_long_prefill_threshold
        self.budget = config.max_num_batched_tokens
        self.num_prefills = 0
        self.num_long = 0
        self.chunk_cap = self.budget

    def _is_long(self, request: Request) -> bool:
        return request.num_tokens - request.num_computed_tokens > self.threshold

    def begin_step(self, running: Iterable[Request], waiting: Iterable[Request]) -> None:
        """Count prefills in flight and size this step's per-prefill chunk
        from how many prefills could run (v0's schedulable_prefills)."""
        self.num_prefills = self.num_long = 0
        for request in running:
            if is_prefilling(request):
                self.num_prefills += 1
                self.num_long += self._is_long(request)
        schedulable, long_seen = self.num_prefills, self.num_long
        for request in waiting:
            if schedulable >= self.max_prefills:
                break
            if self._is_long(request):
                if long_seen >= self.max_long:
                    continue
                long_seen += 1
            schedulable += 1
        self.chunk_cap = self.budget // max(1, min(schedulable, self.max_prefills))

    def admit(self, request: Request) -> Admission:
        if self.num_prefills >= self.max_prefills:
            return Admission.STOP
        if self._is_long(request) and self.num_long >= self.max_long:
            return Admission.SKIP
        return Admission.ADMIT

    def on_admitted(self, request: Request) -> None:
        self.num_prefills += 1
        self.num_long += self._is_long(request)
