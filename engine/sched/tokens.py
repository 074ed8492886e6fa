"""What a step's sampled tokens do to one request: appended up to the first
stop, cut where its grammar ended, and drafts the sampler rejected rewound.

Pure functions of the request, called from ``Scheduler.update_from_output``.
"""

from __future__ import annotations

import logging

from engine.request import Request, RequestStatus
from engine.sched.stop import check_stop
from engine.structured_output.request import Advance

logger = logging.getLogger(__name__)


def append_tokens(
    request: Request, new_token_ids: list[int], max_model_len: int
) -> tuple[list[int], bool]:
    """Append sampled tokens one by one, stopping at the first stop. Returns
    the tokens kept (``new_token_ids``, cut in place) and whether it stopped."""
    for num_new, token_id in enumerate(new_token_ids, 1):
        request.append_output_token_id(token_id)
        if check_stop(request, max_model_len):
            del new_token_ids[num_new:]
            return new_token_ids, True
    return new_token_ids, False


def append_constrained(
    request: Request, step: Advance, new_token_ids: list[int], max_model_len: int
) -> tuple[list[int], bool]:
    """As ``append_tokens``, after the grammar saw the tokens (``step``):
    tokens past its end are dropped; a grammar that completes ends the
    request ("stop"); one that refused a token or failed ends this request
    alone, with an error."""
    kept, stopped = append_tokens(request, new_token_ids[: step.kept], max_model_len)
    if step.error is not None:
        logger.error("request %s: %s", request.request_id, step.error)
        request.status = RequestStatus.FINISHED_ERROR
        request.stop_reason = step.error
        return kept, True
    if step.ended and not stopped:
        request.status = RequestStatus.FINISHED_STOPPED
        return kept, True
    return kept, stopped


def rewind_rejected_drafts(request: Request, num_drafts: int, num_generated: int) -> None:
    """The step computed ``num_drafts`` drafts and sampled ``num_generated``
    tokens: one per accepted draft plus one bonus token. The rest were
    computed for nothing and are computed again."""
    num_rejected = num_drafts - (num_generated - 1)
    if request.num_computed_tokens > 0:
        request.num_computed_tokens -= num_rejected
    # Asynchronous scheduling counted the drafts as placeholders too.
    if request.num_output_placeholders > 0:
        request.num_output_placeholders -= num_rejected
