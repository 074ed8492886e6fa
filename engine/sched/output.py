"""SchedulerOutput: what one step computes, as the model runner needs it.

New requests are sent in full once; requests the runner already holds are
sent as deltas (CachedRequestData). Field names follow vLLM's v1 scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.kv_cache.manager import BlockIds
    from engine.kv_transfer.base import KVConnectorMetadata
    from engine.lora.request import LoRARequest
    from engine.request import Request
    from engine.structured_output.manager import GrammarBitmask


@dataclass
class NewRequestData:
    """A request the runner has not seen (or has dropped): all of it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: BlockIds  # one list per KV cache group
    num_computed_tokens: int
    # P/D: the prompt's last this-many tokens are earlier legs' output.
    num_output_tokens_in_prompt: int = 0
    # Of num_computed_tokens, those a KV connector loads (not local hits).
    num_external_tokens: int = 0
    # The LoRA adapter it runs under (None: the base model).
    lora_request: LoRARequest | None = None

    @classmethod
    def from_request(cls, request: Request, block_ids: BlockIds) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            num_output_tokens_in_prompt=request.num_output_tokens_in_prompt,
            num_external_tokens=request.num_external_computed_tokens,
            lora_request=request.lora_request,
        )


@dataclass
class CachedRequestData:
    """Deltas for requests the runner already holds, in parallel lists.

    ``resumed_req_ids``: requests back from preemption; their block table
    restarts with ``new_block_ids``. ``all_token_ids`` carries the full token
    list of requests that were not scheduled in the previous step (resumed,
    or skipped for a step), since the runner may not have their latest
    sampled token. ``new_block_ids[i]`` is None when no block was added,
    else the added blocks of each KV cache group.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)
    new_block_ids: list[BlockIds | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    # Asynchronous scheduling: requests scheduled while their previous step
    # was in flight. Their num_computed_tokens counts every draft of that
    # step as accepted; the runner, which verified them, knows better.
    in_flight_req_ids: set[str] = field(default_factory=set)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """The plan for one forward pass."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step (including scheduled drafts).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id -> draft tokens scheduled for verification.
    scheduled_spec_decode_tokens: dict[str, list[int]]
    # Leading blocks shared by every request holding blocks.
    num_common_prefix_blocks: int
    # Requests that finished since the last step: the runner drops them.
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: KVConnectorMetadata | None = None
    # Structured output: one mask row per constrained request that samples
    # this step (None when none does).
    grammar_bitmask: GrammarBitmask | None = None
    # Asynchronous scheduling: constrained requests (ids) whose masks wait
    # for the step in flight (Scheduler.fill_grammar_bitmask); the engine
    # fills them before this step runs.
    pending_grammar: list[str] = field(default_factory=list)

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData(), {}, 0, {}, 0, set())
