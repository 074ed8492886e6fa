"""Pure conversions between the wire messages (tandem.v1) and engine types.

No I/O and no gRPC context here: every function maps values. Input is
validated by the engine's front end (``InputProcessor``), told the proto
field names, so bad input raises ``InvalidRequestError`` naming the proto
field, which ``service.errors`` turns into INVALID_ARGUMENT. The finish
reason is the engine's enum up to ``generate_response``, which maps it to
the wire's; an output that ended in error becomes ``RequestFailedError``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format, struct_pb2

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
from service.choices import Call, check_n
from service.errors import RequestFailedError
from service.gen.tandem.v1 import generation_pb2 as pb
from service.sampling_fields import read_sampling

if TYPE_CHECKING:  # not imported at run time: the router runs without torch
    from engine import (
        ChatMessage,
        EngineStatus,
        InputProcessor,
        KVCacheEvent,
        KvEventBatch,
        ProcessedPrompt,
        RequestOutput,
        TokenLogprob,
        WorkerInfo,
    )
    from engine.config import LoRAConfig
    from engine.lora.request import LoRARequest
    from engine.stats import SpecDecodingStats

# ERROR never reaches the wire as a finish reason (see generate_response).
FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


# --- requests --------------------------------------------------------------------


def generate_input(
    msg: pb.GenerateRequest,
    inputs: InputProcessor,
    *,
    served_model_name: str | None = None,
    role: str = "both",
) -> Call:
    """A GenerateRequest, checked and tokenized, as the engine's call.
    ``served_model_name`` None takes any ``model``."""
    if msg.model and served_model_name is not None and msg.model != served_model_name:
        raise InvalidRequestError(
            "model", f"this server serves {served_model_name!r}, not {msg.model!r}"
        )
    kv = kv_transfer_params(msg.kv_transfer_params) if msg.HasField("kv_transfer_params") else None
    n = msg.sampling.n or 1
    check_n(n, "sampling.n", disaggregated=kv is not None or role != "both")
    params = sampling_params(msg)
    # Checked here to name the wire's field; the engine resolves the name
    # again when the request is made (an unload in between refuses it then).
    inputs.loras.resolve(msg.lora_name, field="lora_name")
    options = RequestOptions(
        priority=msg.priority,
        lora_name=msg.lora_name or None,
        kv_transfer_params=kv,
        cache_salt=msg.cache_salt or None,
        num_output_tokens_in_prompt=msg.num_output_tokens_in_prompt,
    )
    return Call(
        request_id=msg.request_id or uuid.uuid4().hex,
        prompt=_prompt(msg, inputs),
        params=params,
        n=n,
        options=options,
    )


def _prompt(msg: pb.GenerateRequest, inputs: InputProcessor) -> ProcessedPrompt:
    kind = msg.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("input", "set one of text, token_ids or chat")
    if kind == "text":
        return inputs.process_text(msg.text, "text")
    if kind == "token_ids":
        return inputs.process_token_ids(list(msg.token_ids.ids), "token_ids")
    return inputs.process_chat(chat_messages(msg.chat), "chat.messages")


def chat_messages(chat: pb.ChatInput) -> list[ChatMessage]:
    """The messages as the front end takes them (it checks them)."""
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def sampling_params(msg: pb.GenerateRequest) -> SamplingParams:
    """The request's sampling and constraint fields, read through the
    table (service/sampling_fields.py); errors name the proto field."""
    return read_sampling("tandem", msg.sampling, prefix="sampling.", request=msg)


def kv_transfer_params(msg: struct_pb2.Struct) -> KVTransferParams:
    """A request's kv_transfer_params, checked key by key."""
    try:
        return KVTransferParams.from_dict(struct_to_dict(msg))
    except KVTransferParamsError as exc:
        raise InvalidRequestError(f"kv_transfer_params.{exc.key}", exc.reason) from exc


def tokenize_input(msg: pb.TokenizeRequest, inputs: InputProcessor) -> list[int]:
    kind = msg.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("input", "set one of text or chat")
    if kind == "text":
        return inputs.tokenize_text(msg.text, "text")
    return inputs.tokenize_chat(chat_messages(msg.chat), "chat.messages")


def struct_to_dict(msg: struct_pb2.Struct) -> dict[str, Any]:
    return json_format.MessageToDict(msg)


def dict_to_struct(values: dict[str, Any]) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(values)
    return out


# --- responses -------------------------------------------------------------------


def generate_response(
    outputs: list[RequestOutput], *, call_id: str | None = None, index: int = 0
) -> pb.GenerateResponse:
    """One response for one or more consecutive outputs of a request (merged
    when the client reads slower than the engine produces). An output that
    ended in error (a KV load failed under kv_load_failure_policy=fail, or
    a grammar refused a sampled token) raises RequestFailedError instead:
    the call ends UNAVAILABLE, the engine's reason in its details."""
    last = outputs[-1]
    if last.finish_reason is FinishReason.ERROR:
        raise RequestFailedError(
            f"request {last.request_id} failed: {last.stop_reason or 'engine error'}; retry it"
        )
    resp = pb.GenerateResponse(request_id=call_id or last.request_id, index=index)
    for out in outputs:
        resp.token_ids.extend(out.token_ids)
        if out.logprobs is not None:
            resp.logprobs.extend(_logprobs(lp) for lp in out.logprobs)
        if out.prompt_logprobs is not None:
            # The wire leaves out the first prompt token's entry (always None).
            resp.prompt_logprobs.extend(_prompt_logprobs(lp) for lp in out.prompt_logprobs[1:])
    resp.text = "".join(out.text for out in outputs)
    if last.finish_reason is not None:
        _finish(resp, last, last.finish_reason)
    return resp


def _finish(resp: pb.GenerateResponse, last: RequestOutput, reason: FinishReason) -> None:
    resp.finish_reason = FINISH_REASONS[reason]
    if isinstance(last.stop_reason, str):
        resp.stop_string = last.stop_reason
    elif isinstance(last.stop_reason, int):
        resp.stop_token_id = last.stop_reason
    resp.usage.prompt_tokens = last.num_prompt_tokens
    resp.usage.completion_tokens = last.num_generated_tokens
    resp.usage.cached_tokens = last.num_cached_tokens
    if last.kv_transfer_params is not None:
        resp.kv_transfer_params.CopyFrom(dict_to_struct(last.kv_transfer_params.to_dict()))


def _logprobs(lp: TokenLogprob) -> pb.Logprobs:
    top = lp.ranked()
    return pb.Logprobs(
        sampled=pb.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, token=lp.text[lp.token_id]
        ),
        top=[
            pb.TokenLogprob(token_id=t, logprob=v, rank=i, token=lp.text[t])
            for i, (t, v) in enumerate(top, 1)
        ],
    )


def _prompt_logprobs(lp: TokenLogprob | None) -> pb.Logprobs:
    return pb.Logprobs() if lp is None else _logprobs(lp)


def model_info(
    info: WorkerInfo,
    *,
    block_size: int,
    role: str,
    connector: str,
    dtype: str,
    lora: LoRAConfig | None = None,
    adapters: Sequence[LoRARequest] = (),
) -> pb.ModelInfo:
    """``lora`` None (LoRA off) leaves ModelInfo.lora unset."""
    out = pb.ModelInfo(
        model_name=info.model_name,
        architecture=info.architecture,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        block_size=block_size,
        role=role,
        kv_connector=connector,
        num_kv_blocks=info.num_blocks,
        dtype=dtype,
        lora_adapters=[lora_adapter(a) for a in adapters],
        weight_format=info.weight_format,
        activations=info.numerics.activations,
        kv_cache_dtype=info.numerics.kv_cache_dtype,
        numerics=info.numerics.path,
        kv_cache_groups=len(info.kv_group_windows),
    )
    if lora is not None:
        out.lora.CopyFrom(
            pb.LoraConfig(
                max_loras=lora.max_loras,
                max_lora_rank=lora.max_lora_rank,
                max_cpu_loras=lora.max_cpu_loras,
            )
        )
    return out


def lora_adapter(request: LoRARequest) -> pb.LoraAdapter:
    return pb.LoraAdapter(
        lora_name=request.lora_name,
        lora_path=request.lora_path,
        rank=request.rank,
        cache_key=request.cache_key,
    )


def server_status(
    status: EngineStatus, adapters: Sequence[LoRARequest] = (), *, weight_format: str = ""
) -> pb.ServerStatus:
    """``weight_format``: the worker's (WorkerInfo.weight_format)."""
    return pb.ServerStatus(
        num_running=status.num_running,
        num_waiting=status.num_waiting,
        kv_cache_usage=status.kv_cache_usage,
        prefix_cache_hit_rate=status.prefix_cache_hit_rate,
        prefix_cache_queries=status.prefix_cache_queries,
        prefix_cache_hits=status.prefix_cache_hits,
        num_preemptions=status.num_preemptions,
        uptime_seconds=status.uptime_seconds,
        draining=status.draining,
        recent_step_ms_p50=status.recent_step_ms_p50,
        recent_token_step_ms_p50=status.recent_token_step_ms_p50,
        kv_connector_queries=status.kv_connector_queries,
        kv_connector_hits=status.kv_connector_hits,
        kv_recomputed_tokens=status.kv_recomputed_tokens,
        kv_leases_lapsed=status.kv_leases_lapsed,
        kv_transfer_failures={k.value: n for k, n in status.kv_transfer_failures.items()},
        kv_held_requests=status.kv_held_requests,
        metrics_errors=status.metrics_errors,
        spec_decoding=_spec_decoding(status.spec_decoding),
        lora_adapters=[lora_adapter(a) for a in adapters],
        weight_format=weight_format,
    )


def _spec_decoding(stats: SpecDecodingStats | None) -> pb.SpecDecodingStatus | None:
    """None (the field unset) while the engine does not speculate."""
    if stats is None:
        return None
    return pb.SpecDecodingStatus(
        num_drafts=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        num_accepted_tokens_per_pos=stats.num_accepted_tokens_per_pos,
    )


def kv_event_batch(batch: KvEventBatch) -> pb.KvEventBatch:
    return pb.KvEventBatch(
        sequence=batch.sequence,
        timestamp=batch.timestamp,
        events=[_kv_event(e) for e in batch.events],
    )


def _kv_event(event: KVCacheEvent) -> pb.KvEvent:
    if isinstance(event, BlockStored):
        return pb.KvEvent(
            stored=pb.BlockStored(
                block_hashes=event.block_hashes,
                parent_block_hash=event.parent_block_hash or b"",
                token_ids=event.token_ids,
                block_size=event.block_size,
            )
        )
    if isinstance(event, BlockRemoved):
        return pb.KvEvent(removed=pb.BlockRemoved(block_hashes=event.block_hashes))
    assert isinstance(event, AllBlocksCleared)
    return pb.KvEvent(cleared=pb.AllBlocksCleared())
