"""SchedulerInterface: the contract between the engine core and a scheduler."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.outputs import DraftTokenIds, EngineCoreOutputs, ModelRunnerOutput
    from engine.request import Request, RequestStatus
    from engine.sched.output import SchedulerOutput
    from engine.stats import SchedulerStats


class SchedulerInterface(ABC):
    """All methods are called from the engine-core thread only."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Decide the next forward pass: how many tokens each request
        computes. Mutates request progress (num_computed_tokens advances as
        if the step succeeds; update_from_output corrects rejected drafts)."""

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Apply a step's results: append tokens, check stops, free finished
        requests. Returns outputs grouped by client index."""

    @abstractmethod
    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Attach draft tokens to be verified in the next step."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError if it can never run."""

    @abstractmethod
    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finish requests from outside (abort, or a stop string found by the
        detokenizer). Unknown or already finished ids are ignored."""

    def release_held_kv(self, request_ids: Iterable[str]) -> None:  # noqa: B027
        """Nobody will fetch the KV blocks that finished requests among these
        still hold for a remote decode (their decode side refused them):
        let them go. Live and unknown ids are ignored. Optional: without a
        KV connector nothing is ever held."""

    @abstractmethod
    def get_num_unfinished_requests(self) -> int: ...

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    @abstractmethod
    def has_finished_requests(self) -> bool:
        """True if finished ids are waiting to be sent with the next step."""

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests()

    @abstractmethod
    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting)."""

    @abstractmethod
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget cached prefixes (e.g. after a weight update)."""

    @abstractmethod
    def make_stats(self) -> SchedulerStats | None: ...

    @abstractmethod
    def shutdown(self) -> None: ...
