"""Request: one generation request and the state the scheduler moves.

The request owns its state (tokens, progress, status); the scheduler only
moves integers and block ids. Field names follow vLLM's v1 ``Request``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.kv_cache.hashing import BlockHash, BlockHasher
from engine.kv_transfer.params import KVTransferParams
from engine.lora.request import LoRARequest
from engine.request_options import RequestOptions
from engine.sampling_params import SamplingParams
from engine.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    """Lifecycle states. Every state after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # its grammar is compiling
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


class FinishReason(enum.StrEnum):
    """Why a request's output ended; equal to its value ("stop", ...), the
    metrics label. The wire has its own enum (service/convert.py)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(eq=False, slots=True)
class Request:
    """A request as the engine sees it.

    ``all_token_ids`` is prompt + outputs; ``num_computed_tokens`` is how many
    of them (plus scheduled drafts) have KV in the cache. The lists are owned
    by the request: read them, never mutate them from outside.
    Identity semantics (eq=False): requests live in sets and dicts.
    The front end (``engine.input_processor``) validated what a caller
    sent, naming the caller's fields; the two checks below are the
    request's own invariants, for code that builds one directly.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.time)
    # What the caller asked besides prompt and sampling (priority, P/D
    # params, cache salt, ...), as the front door built it; read through
    # the properties below.
    options: RequestOptions = field(default_factory=RequestOptions)
    # The LoRA adapter it runs under (None: the base model; the input
    # processor resolves options.lora_name). Its cache_key
    # keys the block hashes: KV computed under one adapter is never reused
    # by another or by the base model.
    lora_request: LoRARequest | None = None
    block_hasher: BlockHasher | None = None

    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    spec_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Asynchronous scheduling: tokens scheduled (sampled or drafted) in a
    # step whose output has not arrived yet; they count in
    # num_computed_tokens but not in all_token_ids.
    num_output_placeholders: int = 0
    # Asynchronous scheduling: the output of the step in flight is void for
    # this request (it was rewound while that step ran): drop it.
    discard_latest_async_tokens: bool = False
    # -1 until the request is first scheduled; then the tokens that came
    # from the local prefix cache or a connector (not recomputed).
    num_cached_tokens: int = -1
    num_external_computed_tokens: int = 0
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_prompt_tokens: int = field(init=False)
    max_tokens: int = field(init=False)
    # Prompt logprobs need the logits of every prompt position, and a
    # prefix-cache hit (or KV a connector loads) skips computing them: such
    # a request computes its whole prompt (it still caches what it computes).
    skip_reading_prefix_cache: bool = field(init=False)
    # Structured output: the grammar's compilation, then its matcher. Such
    # a request starts in WAITING_FOR_FSM, as in vLLM.
    structured_output_request: StructuredOutputRequest | None = field(init=False)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id: must be a non-empty string")
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"prompt_token_ids: request {self.request_id} has an empty prompt")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.max_tokens = self.sampling_params.max_tokens
        self.skip_reading_prefix_cache = self.sampling_params.prompt_logprobs is not None
        constraint = self.sampling_params.structured_outputs
        self.structured_output_request = None
        if constraint is not None:
            self.structured_output_request = StructuredOutputRequest(constraint)
            self.status = RequestStatus.WAITING_FOR_FSM
        if self.block_hasher is not None:
            self.block_hashes = self.block_hasher(self)

    @property
    def priority(self) -> int:
        return self.options.priority

    @property
    def kv_transfer_params(self) -> KVTransferParams | None:
        """P/D: what the prefill leg keeps for a decode pod, or where the
        decode leg finds it (engine.kv_transfer.params)."""
        return self.options.kv_transfer_params

    @property
    def cache_salt(self) -> str | None:
        return self.options.cache_salt

    @property
    def num_output_tokens_in_prompt(self) -> int:
        """The last this-many prompt tokens are output an earlier leg
        generated (P/D: the prefill pod's token in the decode leg's prompt).
        Only the detokenizer cares: the output's text and stop strings start
        there. To the scheduler they are prompt like any other."""
        return self.options.num_output_tokens_in_prompt

    @property
    def lora_cache_key(self) -> str | None:
        return self.lora_request.cache_key if self.lora_request is not None else None

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_id(self, token_id: int) -> None:
        """Append one sampled token (runs for every request every step)."""
        self.output_token_ids.append(token_id)
        all_token_ids = self.all_token_ids
        all_token_ids.append(token_id)
        hasher = self.block_hasher
        # Hash only when this token completes a block.
        if hasher is not None and len(all_token_ids) % hasher.block_size == 0:
            self.block_hashes.extend(hasher(self))

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            self.append_output_token_id(token_id)

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def ready_to_admit(self) -> None:
        """Back from WAITING_FOR_REMOTE_KVS: WAITING, or PREEMPTED if it
        was preempted before (the runner then resumes it from all its
        tokens; as a new request it would know only the prompt)."""
        self.status = RequestStatus.PREEMPTED if self.num_preemptions else RequestStatus.WAITING

    def get_finished_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def __lt__(self, other: Request) -> bool:
        """Priority order: lower priority value, then earlier arrival."""
        if self.priority != other.priority:
            return self.priority < other.priority
        if self.arrival_time != other.arrival_time:
            return self.arrival_time < other.arrival_time
        if self.request_id != other.request_id:
            return self.request_id < other.request_id
        return id(self) < id(other)
