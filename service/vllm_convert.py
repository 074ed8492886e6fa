"""Conversions between the field's engine protocol (``vllm.grpc.engine``,
the stubs of PyPI ``smg-grpc-proto``) and Tandem's engine types.

The Shepherd Model Gateway (smg) drives workers over this protocol: it
tokenizes and detokenizes itself, so requests arrive as token ids and
answers leave as token ids. Sampling fields are read through the table
in ``service.sampling_fields``, as the vLLM servicer reads them: proto3's
zero means "unset" for the fields without presence (``top_p`` 0 is 1.0,
``repetition_penalty`` 0 is 1.0); ``n`` 0 is 1. What
Tandem cannot do yet (structural tags, logprobs of the whole vocabulary,
prompt truncation, images) is refused with the field's name, never ignored;
the other structured-output constraints become ``StructuredOutputParams``.

Pure functions, no gRPC context; ``service.vllm_servicer`` owns the calls.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    FinishReason,
    InvalidRequestError,
    RequestOptions,
    SamplingParams,
)
from engine.kv_transfer.params import KVTransferParams, KVTransferParamsError
from engine.pod_role import kv_role_of
from service.choices import Call, check_n
from service.errors import RequestFailedError
from service.sampling_fields import read_sampling

if TYPE_CHECKING:
    from engine import (
        EngineStatus,
        InputProcessor,
        KVCacheEvent,
        KvEventBatch,
        ProcessedPrompt,
        RequestOutput,
        TokenLogprob,
    )

# The finish reasons vLLM's servicer sends (GenerateComplete.finish_reason).
FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
}

# What vLLM publishes as the medium of its own paged KV cache; Tandem's
# paged cache is the same tier whatever its device (see docs/kv-events.md).
MEDIUM = "GPU"


@dataclass(frozen=True)
class VllmGenerateInput:
    """A GenerateRequest, checked and tokenized."""

    call: Call
    stream: bool


# --- requests --------------------------------------------------------------------


def generate_input(
    msg: vpb.GenerateRequest, inputs: InputProcessor, *, role: str, lora_name: str | None = None
) -> VllmGenerateInput:
    """Raises InvalidRequestError naming the proto field that is wrong.
    ``lora_name``: the adapter of the port the request came in on (the
    protocol has no field for one; service/adapter_ports.py)."""
    if not msg.request_id:
        raise InvalidRequestError("request_id", "must be set (the gateway's id for Abort)")
    _refuse_unsupported(msg)
    n = msg.sampling_params.n or 1
    kv = _kv_transfer_params(msg)
    if kv is None and role == "prefill":
        # smg's prefill leg carries no params: this pod's connector makes
        # the hand-over's params itself, for the decode leg to relay back.
        kv = KVTransferParams(do_remote_decode=True)
    check_n(n, "sampling_params.n", disaggregated=kv is not None or role != "both")
    call = Call(
        request_id=msg.request_id,
        prompt=_prompt(msg, inputs),
        params=sampling_params(msg.sampling_params),
        n=n,
        options=RequestOptions(lora_name=lora_name, kv_transfer_params=kv),
    )
    return VllmGenerateInput(call, msg.stream)


def _prompt(msg: vpb.GenerateRequest, inputs: InputProcessor) -> ProcessedPrompt:
    kind = msg.WhichOneof("input")
    if kind == "tokenized":
        return inputs.process_token_ids(list(msg.tokenized.input_ids), "tokenized.input_ids")
    if kind == "text":
        return inputs.process_text(msg.text, "text")
    raise InvalidRequestError("input", "set one of tokenized or text")


def _refuse_unsupported(msg: vpb.GenerateRequest) -> None:
    """What the request asks that no sampling field holds (the sampling
    fields' own refusals are in service/sampling_fields.py)."""
    if msg.sampling_params.HasField("truncate_prompt_tokens"):
        raise InvalidRequestError(
            "sampling_params.truncate_prompt_tokens", "prompt truncation is not supported"
        )
    if msg.HasField("mm_inputs") or len(msg.extra_mm_inputs) or msg.HasField("media_refs"):
        raise InvalidRequestError("mm_inputs", "this model takes text only")


def sampling_params(msg: vpb.SamplingParams) -> SamplingParams:
    """Read through the table (service/sampling_fields.py), as vLLM's
    servicer reads the fields; errors name the proto field."""
    return read_sampling("vllm", msg, prefix="sampling_params.")


def _kv_transfer_params(msg: vpb.GenerateRequest) -> KVTransferParams | None:
    if not msg.HasField("kv_transfer_params_json") or not msg.kv_transfer_params_json:
        return None
    try:
        values = json.loads(msg.kv_transfer_params_json)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError("kv_transfer_params_json", f"is not JSON: {exc}") from None
    if not isinstance(values, dict):
        raise InvalidRequestError("kv_transfer_params_json", "must be a JSON object")
    try:
        return KVTransferParams.from_dict(values)
    except KVTransferParamsError as exc:
        raise InvalidRequestError(f"kv_transfer_params_json.{exc.key}", exc.reason) from exc


# --- responses -------------------------------------------------------------------


@dataclass
class ChoiceOutput:
    """One choice's outputs merged: the tokens (and their logprobs) new
    since the last message sent for it, and the latest counts."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    last: RequestOutput
    # On a choice's first output only (when asked for): None first.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @classmethod
    def merge(cls, index: int, outputs: list[RequestOutput]) -> ChoiceOutput:
        tokens = [t for out in outputs for t in out.token_ids]
        lps = [lp for out in outputs for lp in (out.logprobs or ())]
        asked = any(out.logprobs is not None for out in outputs)
        prompt = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
        return cls(index, tokens, lps if asked else None, outputs[-1], prompt)


def chunk(choice: ChoiceOutput, num_logprobs: int | None) -> vpb.GenerateResponse:
    """A streamed delta (vLLM's servicer: counts are the delta's; the
    gateway adds them up)."""
    last = choice.last
    return vpb.GenerateResponse(
        chunk=vpb.GenerateStreamChunk(
            token_ids=choice.token_ids,
            prompt_tokens=last.num_prompt_tokens,
            completion_tokens=len(choice.token_ids),
            cached_tokens=last.num_cached_tokens,
            output_logprobs=_output_logprobs(choice, num_logprobs),
            input_logprobs=_input_logprobs(choice),
            index=choice.index,
        )
    )


def complete(choice: ChoiceOutput, num_logprobs: int | None) -> vpb.GenerateResponse:
    """A choice's end. Streamed, ``choice`` holds the last delta (sent as a
    chunk just before); not streamed, the whole output. Raises
    RequestFailedError for an output that ended in error."""
    last = choice.last
    reason = last.finish_reason
    if reason is FinishReason.ERROR or reason is None:
        raise RequestFailedError(
            f"request {last.request_id} failed: {last.stop_reason or 'engine error'}; retry it"
        )
    done = vpb.GenerateComplete(
        output_ids=choice.token_ids,
        finish_reason=FINISH_REASONS[reason],
        prompt_tokens=last.num_prompt_tokens,
        completion_tokens=len(choice.token_ids),
        cached_tokens=last.num_cached_tokens,
        output_logprobs=_output_logprobs(choice, num_logprobs),
        input_logprobs=_input_logprobs(choice),
        index=choice.index,
    )
    if isinstance(last.stop_reason, str):
        done.matched_stop_str = last.stop_reason
    elif isinstance(last.stop_reason, int):
        done.matched_token_id = last.stop_reason
    if last.kv_transfer_params is not None:
        done.kv_transfer_params_json = json.dumps(last.kv_transfer_params.to_dict())
    return vpb.GenerateResponse(complete=done)


def _output_logprobs(choice: ChoiceOutput, num_logprobs: int | None) -> vpb.OutputLogProbs | None:
    if not choice.logprobs:
        return None
    out = vpb.OutputLogProbs()
    for lp in choice.logprobs:
        out.token_ids.append(lp.token_id)
        out.token_logprobs.append(lp.logprob)
        if num_logprobs:
            top = lp.ranked()[:num_logprobs]
            out.top_logprobs.append(
                vpb.TopLogProbs(token_ids=[t for t, _ in top], values=[v for _, v in top])
            )
    return out


def _input_logprobs(choice: ChoiceOutput) -> vpb.InputLogProbs | None:
    """The prompt's logprobs, one entry per prompt token (the first, which
    has no context, without a value), as vLLM's servicer sends them."""
    if choice.prompt_logprobs is None:
        return None
    out = vpb.InputLogProbs()
    for token_id, lp in zip(choice.last.prompt_token_ids, choice.prompt_logprobs, strict=False):
        out.token_ids.append(token_id)
        entry = vpb.InputTokenLogProb()
        top = vpb.TopLogProbs()
        if lp is not None:
            entry.value = lp.logprob
            ranked = lp.ranked()
            top = vpb.TopLogProbs(token_ids=[t for t, _ in ranked], values=[v for _, v in ranked])
        out.token_logprobs.append(entry)
        out.top_logprobs.append(top)
    return out


# --- model, server, loads --------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    """What GetModelInfo answers (the engine's WorkerInfo plus the name the
    pod serves under)."""

    served_model_name: str
    model_path: str
    tokenizer_path: str  # the model's directory, or one with --chat-template's template
    architecture: str
    model_type: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int | None


def model_type(model_dir: Path) -> str:
    """The HF ``model_type`` in the model's config.json ("" if unreadable)."""
    try:
        value = json.loads((model_dir / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return value if isinstance(value, str) else ""


def model_info(facts: ModelFacts) -> vpb.GetModelInfoResponse:
    return vpb.GetModelInfoResponse(
        model_path=facts.model_path,
        is_generation=True,
        max_context_length=facts.max_model_len,
        max_req_input_len=facts.max_model_len - 1,
        vocab_size=facts.vocab_size,
        supports_vision=False,
        served_model_name=facts.served_model_name,
        tokenizer_path=facts.tokenizer_path,
        model_type=facts.model_type,
        architectures=[facts.architecture],
        eos_token_ids=facts.eos_token_ids,
        bos_token_id=-1 if facts.bos_token_id is None else facts.bos_token_id,
        pad_token_id=-1 if facts.pad_token_id is None else facts.pad_token_id,
    )


@dataclass(frozen=True)
class ServerFacts:
    """What GetServerInfo answers besides the live counts."""

    role: str  # prefill, decode or both; its kv_role is engine.pod_role's
    kv_connector: str
    engine_id: str
    block_size: int
    dtype: str
    max_num_seqs: int
    kv_cache_dtype: str = "auto"  # vLLM's spelling (vllm_kv_cache_dtype)


def vllm_kv_cache_dtype(cache_dtype: str, dtype: str) -> str:
    """The KV cache's dtype as vLLM's --kv-cache-dtype spells it: "auto" for
    the model's dtype, else its name (as resolved: "bfloat16" where Tandem's
    fast path is the default, engine/numerics.py)."""
    return "auto" if cache_dtype == dtype else cache_dtype


def server_info(facts: ServerFacts, status: EngineStatus) -> vpb.GetServerInfoResponse:
    connected = bool(facts.kv_connector)
    return vpb.GetServerInfoResponse(
        active_requests=status.num_running + status.num_waiting,
        is_paused=status.draining,
        uptime_seconds=status.uptime_seconds,
        server_type="tandem-grpc",
        kv_connector=facts.kv_connector,
        kv_role=kv_role_of(facts.role) if connected else "",
        kv_engine_id=facts.engine_id if connected else "",
        data_parallel_size=1,
        kv_cache_dtype=facts.kv_cache_dtype,
        block_size=facts.block_size,
        model_dtype=f"torch.{facts.dtype}",
        max_num_seqs=facts.max_num_seqs,
    )


def loads(
    status: EngineStatus, *, num_blocks: int, block_size: int, max_num_seqs: int, timestamp: str
) -> vpb.GetLoadsResponse:
    """One SchedulerLoad (Tandem runs no data parallelism)."""
    step_ms = status.recent_token_step_ms_p50
    throughput = status.num_running * 1000.0 / step_ms if step_ms > 0 else 0.0
    capacity = (num_blocks - 1) * block_size  # block 0 is the null block
    load = vpb.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=status.num_running,
        num_waiting_reqs=status.num_waiting,
        num_total_reqs=status.num_running + status.num_waiting,
        num_used_tokens=round(status.kv_cache_usage * capacity),
        max_total_num_tokens=capacity,
        token_usage=status.kv_cache_usage,
        gen_throughput=throughput,
        cache_hit_rate=status.prefix_cache_hit_rate,
        utilization=min(1.0, status.num_running / max_num_seqs) if max_num_seqs else 0.0,
        max_running_requests=max_num_seqs,
    )
    return vpb.GetLoadsResponse(
        timestamp=timestamp, version="tandem", dp_rank_count=1, loads=[load]
    )


# --- KV events -------------------------------------------------------------------


def fold_hash(block_hash: bytes) -> int:
    """A 32-byte block hash as the protocol's signed 64-bit one: the last 8
    bytes, big-endian (vLLM's rule for its int hashes), read as int64."""
    value = int.from_bytes(block_hash[-8:], "big")
    return value - (1 << 64) if value >= 1 << 63 else value


def events_of_model(batch: KvEventBatch, lora_name: str | None) -> KvEventBatch:
    """The batch as one model's worker sees it (the base model's, or a LoRA
    adapter's on its own port): blocks stored under another model are left
    out, so smg's cache-aware routing matches a request against the blocks
    its model can reuse. Removals and clears name no model and all stay
    (smg ignores a removed hash it never saw)."""
    if not any(isinstance(e, BlockStored) for e in batch.events):
        return batch
    kept = [e for e in batch.events if not isinstance(e, BlockStored) or e.lora_name == lora_name]
    return dataclasses.replace(batch, events=kept)


def kv_event_batch(batch: KvEventBatch, first_event_id: int) -> common_pb2.KvEventBatch:
    """Events are numbered on from ``first_event_id``."""
    return common_pb2.KvEventBatch(
        sequence_number=batch.sequence,
        timestamp=batch.timestamp,
        events=[_kv_event(e, first_event_id + i) for i, e in enumerate(batch.events)],
    )


def _kv_event(event: KVCacheEvent, event_id: int) -> common_pb2.KvCacheEvent:
    if isinstance(event, BlockStored):
        size = event.block_size
        blocks = [
            common_pb2.KvBlock(
                block_hash=fold_hash(h),
                token_ids=event.token_ids[i * size : (i + 1) * size],
                block_size=size,
            )
            for i, h in enumerate(event.block_hashes)
        ]
        stored = common_pb2.KvBlocksStored(
            blocks=blocks, tier=common_pb2.KV_CACHE_TIER_DEVICE, medium=MEDIUM
        )
        if event.parent_block_hash is not None:
            stored.parent_block_hash = fold_hash(event.parent_block_hash)
        return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
    if isinstance(event, BlockRemoved):
        removed = common_pb2.KvBlocksRemoved(
            block_hashes=[fold_hash(h) for h in event.block_hashes],
            tier=common_pb2.KV_CACHE_TIER_DEVICE,
            medium=MEDIUM,
        )
        return common_pb2.KvCacheEvent(event_id=event_id, removed=removed)
    assert isinstance(event, AllBlocksCleared)
    return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())
