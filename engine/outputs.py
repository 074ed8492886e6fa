"""What the model runner returns and what the engine core emits per step."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.kv_cache.events import KVCacheEvent
from engine.kv_transfer.params import KVTransferParams
from engine.request import FinishReason
from engine.stats import KVConnectorStats, SchedulerStats


@dataclass
class LogprobsLists:
    """Logprobs of sampled tokens, one row per sampled token.

    Row ``i`` holds ``[sampled, top_1, ..., top_n]`` token ids and their
    logprobs, and the rank of the sampled token. Rows are in request-index
    order; ``cu_num_generated_tokens`` (prefix sums, length num_reqs + 1)
    maps a request to its rows when requests sample more than one token
    (speculative decoding); None means one row per request.
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]
    cu_num_generated_tokens: list[int] | None = None

    def slice_request(self, req_index: int, num_tokens: int) -> LogprobsLists:
        start = (
            req_index
            if self.cu_num_generated_tokens is None
            else self.cu_num_generated_tokens[req_index]
        )
        end = start + num_tokens
        return LogprobsLists(
            self.logprob_token_ids[start:end],
            self.logprobs[start:end],
            self.sampled_token_ranks[start:end],
        )


@dataclass
class PromptLogprobs:
    """Logprobs of some of one request's prompt tokens, from one step.

    Row ``i`` is prompt token ``first_token + i`` given the tokens before it
    (computed from the logits at the position before it), in the shape of
    ``LogprobsLists``: ``[prompt token, top_1, ..., top_k]`` ids and logprobs,
    and the prompt token's rank. A prefill chunk gives the rows of the
    tokens after its positions; a prompt computed again (after preemption)
    gives the same rows again.
    """

    first_token: int  # index in the prompt of row 0's token; at least 1
    logprobs: LogprobsLists

    @property
    def num_tokens(self) -> int:
        return len(self.logprobs.sampled_token_ranks)


@dataclass
class KVConnectorOutput:
    """What the worker-side connector reports after a step.

    ``finished_sending``: requests whose KV has been read by the consumer
    (their delayed-free blocks can go). ``finished_recving``: requests whose
    asynchronous load completed (they may leave WAITING_FOR_REMOTE_KVS).
    ``invalid_block_ids``: blocks whose load failed; the scheduler rewinds
    the affected requests so those tokens are recomputed. ``stats``: the
    failures (by kind) and lapsed leases the connector saw this step.
    """

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    invalid_block_ids: set[int] = field(default_factory=set)
    stats: KVConnectorStats | None = None

    def is_empty(self) -> bool:
        has_stats = self.stats is not None and not self.stats.is_empty()
        return not (
            self.finished_sending or self.finished_recving or self.invalid_block_ids or has_stats
        )


@dataclass
class ModelRunnerOutput:
    """One step's results, indexed by position in ``req_ids``.

    ``sampled_token_ids[i]`` is empty for a request still mid-prefill, one
    token for a decode, several when drafts were accepted.
    ``prompt_logprobs_dict`` holds, for the requests that asked for prompt
    logprobs and computed prompt positions this step, those tokens' logprobs.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: LogprobsLists | None = None
    kv_connector_output: KVConnectorOutput | None = None
    prompt_logprobs_dict: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Asynchronous scheduling: requests whose drafts were placeholders, and
    # how many real drafts the runner verified in their place (the rest were
    # never computed; the scheduler counts them as rejected, its stats not
    # as drafts). None when no step had placeholders.
    num_verified_drafts: dict[str, int] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


@dataclass
class DraftTokenIds:
    """Draft (speculative) tokens proposed for the next step."""

    req_ids: list[str]
    draft_token_ids: list[list[int]]


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens (and the end, if it ended) of one request in one step.

    A request mid-prefill has one with no tokens when the step computed some
    of its prompt logprobs (``new_prompt_logprobs``).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    new_logprobs: LogprobsLists | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: KVTransferParams | None = None
    num_cached_tokens: int = 0
    new_prompt_logprobs: PromptLogprobs | None = None
    # Set when the engine refused the request after admitting it (its
    # grammar did not compile): the caller gets this error, not an output.
    error: InvalidRequestError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    """Everything one step produced for one client."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    kv_events: list[KVCacheEvent] | None = None
