"""Pure conversions between the wire messages (tandem.v1) and engine types.

No I/O and no gRPC context here: every function maps values, and bad input
raises `InvalidRequestError` (from the engine) naming the proto field, which
`service.errors` turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format, struct_pb2

from connectors.kv_transfer_params import KVTransferParams, KVTransferParamsError
from engine.async_engine import EngineStatus, KvEventBatch, StreamDelta
from engine.input_processor import InputProcessor, InvalidRequestError, ProcessedPrompt
from engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from engine.output_processor import TokenLogprob
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.worker.worker import WorkerInfo
from service.gen.tandem.v1 import generation_pb2 as pb

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


@dataclass(frozen=True)
class GenerateInput:
    """A GenerateRequest, checked and tokenized."""

    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    priority: int
    kv_transfer_params: KVTransferParams | None
    num_output_tokens_in_prompt: int


# --- requests --------------------------------------------------------------------


def generate_input(msg: pb.GenerateRequest, inputs: InputProcessor) -> GenerateInput:
    prompt = _prompt(msg, inputs)
    return GenerateInput(
        request_id=msg.request_id or uuid.uuid4().hex,
        prompt=prompt,
        params=sampling_params(msg.sampling) if msg.HasField("sampling") else SamplingParams(),
        priority=msg.priority,
        kv_transfer_params=kv_transfer_params(msg.kv_transfer_params)
        if msg.HasField("kv_transfer_params")
        else None,
        num_output_tokens_in_prompt=msg.num_output_tokens_in_prompt,
    )


def _prompt(msg: pb.GenerateRequest, inputs: InputProcessor) -> ProcessedPrompt:
    kind = msg.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("input", "set one of text, token_ids or chat")
    if kind == "text":
        if not msg.text:
            raise InvalidRequestError("text", "is empty")
        return inputs.process_prompt(msg.text)
    if kind == "token_ids":
        ids = list(msg.token_ids.ids)
        if not ids:
            raise InvalidRequestError("token_ids", "is empty")
        inputs.check_length(len(ids))  # before looking at each id
        _check_vocab("token_ids", ids, inputs.vocab_size)
        return inputs.process_prompt(ids)
    return inputs.process_chat(chat_messages(msg.chat, "chat.messages"), "chat.messages")


def chat_messages(chat: pb.ChatInput, field: str) -> list[dict[str, str]]:
    messages = []
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise InvalidRequestError(f"{field}[{i}].role", "is empty")
        messages.append({"role": m.role, "content": m.content})
    if not messages:
        raise InvalidRequestError(field, "must hold at least one message")
    return messages


def _check_vocab(field: str, ids: list[int], vocab_size: int) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(
                f"{field}[{i}]", f"token id {t} is outside the vocabulary [0, {vocab_size})"
            )


def sampling_params(msg: pb.SamplingParams) -> SamplingParams:
    values: dict[str, Any] = {
        "min_tokens": msg.min_tokens,
        "top_k": _signed32(msg.top_k),
        "stop": list(msg.stop),
        "stop_token_ids": list(msg.stop_token_ids),
        "ignore_eos": msg.ignore_eos,
    }
    for name in ("max_tokens", "temperature", "top_p", "seed", "logprobs"):
        if msg.HasField(name):
            values[name] = getattr(msg, name)
    try:
        return SamplingParams(**values)
    except SamplingParamsError as exc:
        raise InvalidRequestError(f"sampling.{exc.field}", str(exc).split(": ", 1)[-1]) from exc


def _signed32(value: int) -> int:
    """A uint32 field read as the int32 a client may have meant: -1 (vLLM's
    "top_k off") sent from an int32 arrives as 4294967295, and is taken as
    -1 (off); other negatives are then refused instead of acting as "off"."""
    return value - (1 << 32) if value >= 1 << 31 else value


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
        if not msg.text:
            raise InvalidRequestError("text", "is empty")
        return inputs.tokenize(msg.text)
    messages = chat_messages(msg.chat, "chat.messages")
    return inputs.tokenize(inputs.render_chat(messages, "chat.messages"))


def struct_to_dict(msg: struct_pb2.Struct) -> dict[str, Any]:
    return json_format.MessageToDict(msg)


def dict_to_struct(values: dict[str, Any]) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(values)
    return out


# --- responses -------------------------------------------------------------------


def generate_response(
    deltas: list[StreamDelta], tokenizer_decode: Any, want_logprobs: bool
) -> pb.GenerateResponse:
    """One response for one or more consecutive deltas of a request (deltas
    are merged when the client reads slower than the engine produces)."""
    last = deltas[-1]
    resp = pb.GenerateResponse(request_id=last.request_id)
    for d in deltas:
        resp.token_ids.extend(d.new_token_ids)
        if want_logprobs:
            resp.logprobs.extend(_logprobs(lp, tokenizer_decode) for lp in d.new_logprobs)
    resp.text = "".join(d.new_text for d in deltas)
    if last.finished:
        _finish(resp, last)
    return resp


def _finish(resp: pb.GenerateResponse, last: StreamDelta) -> None:
    if last.finish_reason == "error":
        # Reached only through engine failure, which the servicer reports as
        # an error status instead; kept total for safety.
        resp.finish_reason = pb.FINISH_REASON_ABORT
    else:
        resp.finish_reason = FINISH_REASONS.get(last.finish_reason or "", pb.FINISH_REASON_ABORT)
    if isinstance(last.stop_reason, str):
        resp.stop_string = last.stop_reason
    elif isinstance(last.stop_reason, int):
        resp.stop_token_id = last.stop_reason
    resp.usage.prompt_tokens = last.num_prompt_tokens
    resp.usage.completion_tokens = last.num_generated_tokens
    resp.usage.cached_tokens = last.num_cached_tokens
    if last.kv_transfer_params is not None:
        resp.kv_transfer_params.CopyFrom(dict_to_struct(last.kv_transfer_params.to_dict()))


def _logprobs(lp: TokenLogprob, decode: Any) -> pb.Logprobs:
    top = sorted(lp.top.items(), key=lambda kv: kv[1], reverse=True)
    return pb.Logprobs(
        sampled=pb.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, token=decode(lp.token_id)
        ),
        top=[
            pb.TokenLogprob(token_id=t, logprob=v, rank=i, token=decode(t))
            for i, (t, v) in enumerate(top, 1)
        ],
    )


def model_info(info: WorkerInfo, *, block_size: int, role: str, connector: str, dtype: str) -> Any:
    return pb.ModelInfo(
        model_name=info.model_name,
        architecture=info.architecture,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        block_size=block_size,
        role=role,
        kv_connector=connector,
        num_kv_blocks=info.num_blocks,
        dtype=dtype,
    )


def server_status(status: EngineStatus) -> pb.ServerStatus:
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
