"""Checks and tokenizes what a caller asks for, and makes the Request.

Everything a caller can get wrong is caught here, before the request reaches
the scheduler, as an ``InvalidRequestError`` naming the field, so a bad
request never disturbs the ones already running.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from engine.request import Request
from engine.sampling_params import SamplingParams

ChatMessage = dict[str, str]


class InvalidRequestError(ValueError):
    """A request is malformed; ``field`` names what was wrong."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class ProcessedPrompt:
    token_ids: list[int]
    text: str | None


class InputProcessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        vocab_size: int,
        max_model_len: int,
        eos_token_id: int | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text)
        return ids

    def render_chat(self, messages: list[ChatMessage]) -> str:
        """Renders chat messages with the model's chat template."""
        if not messages:
            raise InvalidRequestError("messages", "must hold at least one message")
        for i, message in enumerate(messages):
            if set(message) != {"role", "content"}:
                raise InvalidRequestError(
                    f"messages[{i}]", f"expected keys role and content, got {sorted(message)}"
                )
        if self.tokenizer.chat_template is None:
            raise InvalidRequestError("messages", "this model has no chat template")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return str(text)

    def process_prompt(self, prompt: str | list[int]) -> ProcessedPrompt:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "is empty")
            return ProcessedPrompt(self.tokenize(prompt), prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise InvalidRequestError("prompt_token_ids", "is empty")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                "prompt_token_ids",
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
            )
        return ProcessedPrompt(token_ids, None)

    def make_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        *,
        priority: int = 0,
        kv_transfer_params: dict[str, Any] | None = None,
        arrival_time: float | None = None,
        num_output_tokens_in_prompt: int = 0,
    ) -> Request:
        """``num_output_tokens_in_prompt``: see ``Request`` (the wire field
        of the same name documents the semantics)."""
        num_tokens = len(prompt.token_ids)
        _check_output_in_prompt(num_output_tokens_in_prompt, num_tokens)
        if num_tokens >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"has {num_tokens} tokens; the limit is max_model_len - 1 = "
                f"{self.max_model_len - 1} (room for at least one generated token)",
            )
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise InvalidRequestError(
                "stop_token_ids", f"{bad_stop} are outside the vocabulary [0, {self.vocab_size})"
            )
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            kv_transfer_params=kv_transfer_params,
            num_output_tokens_in_prompt=num_output_tokens_in_prompt,
        )


def _check_output_in_prompt(count: int, num_prompt_tokens: int) -> None:
    """The output tokens said to end the prompt must be in it."""
    if not isinstance(count, int) or isinstance(count, bool):
        raise InvalidRequestError("num_output_tokens_in_prompt", f"must be an int, got {count!r}")
    if not 0 <= count <= num_prompt_tokens:
        raise InvalidRequestError(
            "num_output_tokens_in_prompt",
            f"must be between 0 and the prompt's {num_prompt_tokens} tokens, got {count}",
        )
