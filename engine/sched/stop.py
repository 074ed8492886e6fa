"""Stop checks and a list helper used on the scheduler's hot path."""

from __future__ import annotations

from typing import TypeVar

from engine.request import Request, RequestStatus

T = TypeVar("T")


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the finished status if the request's last token ends it.

    Order matters and follows vLLM: nothing stops before ``min_tokens``;
    then EOS (unless ignore_eos), then stop_token_ids (recorded as the stop
    reason), then the length limits (max_tokens, max_model_len).
    One departure: a request whose ``min_tokens`` cannot fit before
    max_model_len ends there (vLLM would leave it unschedulable forever).
    Stop *strings* are the detokenizer's job (finish_requests).
    """
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if num_output < params.min_tokens:
        if len(request.all_token_ids) >= max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
    last = request.output_token_ids[-1]
    if last == request.eos_token_id and not params.ignore_eos:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if params.stop_token_ids and last in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    if len(request.all_token_ids) >= max_model_len or num_output >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def remove_all(items: list[T], to_remove: set[T]) -> list[T]:
    """``items`` without ``to_remove``; in place for the common single item."""
    if not to_remove:
        return items
    if len(to_remove) == 1:
        item = next(iter(to_remove))
        if item in items:
            items.remove(item)
        return items
    return [x for x in items if x not in to_remove]
