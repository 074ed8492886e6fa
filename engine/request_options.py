"""RequestOptions: what a request asks of the engine besides its prompt and
sampling, in one value.

A front door (``service.convert``, ``service.vllm_convert``, ``LLM``) builds
one; ``InputProcessor.make_request`` checks it against the prompt and the
loaded adapters and hands it to the ``Request``, which holds it unchanged
(``Request.options``; the seeds' names ``priority``, ``kv_transfer_params``
and ``cache_salt`` read through it). A new option is a field here, the
converters that fill it, and the code that reads it: nothing between.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv_transfer.params import KVTransferParams


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """``priority``: lower is served first under the priority policy.
    ``lora_name``: a loaded LoRA adapter's name (None: the base model).
    ``kv_transfer_params``: P/D, what the prefill leg keeps for a decode pod
    or where the decode leg finds it. ``cache_salt``: keys the request's
    prefix-cache blocks, so only requests with the same salt share them
    (None: the unsalted cache). ``num_output_tokens_in_prompt``: the last
    this-many prompt tokens are output an earlier leg generated (see
    ``Request``). Checked by ``InputProcessor.make_request``, naming the
    field."""

    priority: int = 0
    lora_name: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    cache_salt: str | None = None
    num_output_tokens_in_prompt: int = 0
