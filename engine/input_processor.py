"""Checks and tokenizes what a caller asks for, and makes the Request.

The one place input is validated, for ``LLM`` and the service alike:
everything a caller can get wrong is caught here, before the request
reaches the scheduler, as an ``InvalidRequestError`` naming the field, so a
bad request never disturbs the ones already running. Each ``process_*``
method returns a ``ProcessedPrompt`` that passed every check of the prompt;
``make_request`` checks the rest and builds the ``Request``. Callers name
their input fields (``prompt`` offline, ``text`` or ``token_ids`` on the
wire); the size bounds always name ``prompt``, the text the model reads.

Tokenizing costs CPU in proportion to the text (~1 s per MB): text too long
to fit ``max_model_len`` whatever it tokenizes to is refused by its size
first (``max_prompt_bytes``), and the service calls these methods off its
event loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TypedDict

from transformers import PreTrainedTokenizerBase

from engine.chat_template import ChatMessage, ChatTemplate
from engine.errors import InvalidRequestError
from engine.kv_transfer.params import KVTransferParams
from engine.lora.registry import LoRARegistry
from engine.request import Request
from engine.request_options import RequestOptions
from engine.sampling_params import SamplingParams


class TokensPrompt(TypedDict):
    """vLLM's dict form of a token-ids prompt."""

    prompt_token_ids: list[int]


class TextPrompt(TypedDict):
    """vLLM's dict form of a text prompt."""

    prompt: str


# What LLM.generate takes as one prompt.
PromptInput = str | list[int] | TokensPrompt | TextPrompt


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt that passed the checks: not empty, every id in the
    vocabulary, shorter than max_model_len. Made by ``InputProcessor``."""

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
        loras: LoRARegistry | None = None,
    ) -> None:
        """``loras``: the adapters requests may name (None: none)."""
        self.tokenizer = tokenizer
        self.loras = loras or LoRARegistry(None, None)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        # No token stands for more input than its own string's UTF-8 bytes:
        # a byte-level BPE token's string spells each byte it covers as one
        # character of 1 or 2 bytes, a SentencePiece token's spells the
        # space it covers as the 3-byte "▁" and an unknown byte as "<0xNN>",
        # and an added token is its literal text. So text of more than
        # ``(max_model_len - 1) * max_token_bytes`` bytes is more than
        # max_model_len - 1 tokens, and is refused untokenized. (This holds
        # as long as the tokenizer's normalizer never deletes input, true
        # of the Llama-family tokenizers; the exact count still follows.)
        self.max_token_bytes = max(len(t.encode()) for t in tokenizer.get_vocab())
        self.max_prompt_bytes = (max_model_len - 1) * self.max_token_bytes
        self.chat = ChatTemplate(tokenizer)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``, unchecked (see ``tokenize_text``)."""
        ids: list[int] = self.tokenizer.encode(text)
        return ids

    def tokenize_text(self, text: str, field: str = "text") -> list[int]:
        """Token ids of non-empty ``text``, whatever its length (the
        Tokenize RPC: no prompt is made of them)."""
        _check_not_empty(field, text)
        return self.tokenize(text)

    def render_chat(self, messages: list[ChatMessage], field: str = "messages") -> str:
        """Renders chat messages with the model's chat template (checked:
        ``ChatTemplate.render``); ``field`` names the messages in errors.
        For display: tokenize chat with ``tokenize_chat`` or
        ``process_chat``, which keep special tokens in content text."""
        return self.chat.render(messages, field)

    def tokenize_chat(self, messages: list[ChatMessage], field: str = "messages") -> list[int]:
        """Token ids of chat messages, unchecked for length (the Tokenize
        RPC); see ``ChatTemplate.encode``."""
        return self.chat.encode(messages, field).token_ids

    def process_prompt(self, prompt: PromptInput) -> ProcessedPrompt:
        """A prompt as ``LLM.generate`` takes it: text, token ids, or vLLM's
        dict forms of either (``{"prompt": text}``, ``{"prompt_token_ids":
        ids}``)."""
        if isinstance(prompt, dict):
            return self._process_dict(dict(prompt))
        if isinstance(prompt, str):
            return self.process_text(prompt)
        if isinstance(prompt, list | tuple):
            return self.process_token_ids(list(prompt))
        raise InvalidRequestError(
            "prompt", f"must be text, token ids or a dict of either, not {type(prompt).__name__}"
        )

    def _process_dict(self, prompt: dict[str, object]) -> ProcessedPrompt:
        ids, text = prompt.get("prompt_token_ids"), prompt.get("prompt")
        if set(prompt) == {"prompt_token_ids"} and isinstance(ids, list | tuple):
            return self.process_token_ids(list(ids))
        if set(prompt) == {"prompt"} and isinstance(text, str):
            return self.process_text(text)
        raise InvalidRequestError(
            "prompt",
            "a dict prompt has one key: 'prompt' (text) or 'prompt_token_ids' (token ids); "
            f"got {sorted(map(str, prompt))}",
        )

    def process_text(self, text: str, field: str = "prompt") -> ProcessedPrompt:
        """Text as a prompt: refused by its size before it is tokenized
        when it cannot fit max_model_len."""
        _check_not_empty(field, text)
        self.check_size("prompt", len(text.encode("utf-8", "surrogatepass")))
        token_ids = self.tokenize(text)
        self.check_length(len(token_ids))
        return ProcessedPrompt(token_ids, text)

    def process_token_ids(
        self, prompt: list[int], field: str = "prompt_token_ids"
    ) -> ProcessedPrompt:
        """Token ids as a prompt; the length is checked before each id."""
        token_ids = list(prompt)
        _check_not_empty(field, token_ids)
        self.check_length(len(token_ids))
        self._check_vocab(field, token_ids)
        return ProcessedPrompt(token_ids, None)

    def process_chat(self, messages: list[ChatMessage], field: str = "messages") -> ProcessedPrompt:
        """Chat messages as a prompt: refused by their size before they are
        rendered and tokenized when they cannot fit max_model_len."""
        contents = (m.get("content", "") for m in messages)
        self.check_size(field, sum(len(c.encode("utf-8", "surrogatepass")) for c in contents))
        chat = self.chat.encode(messages, field)
        self.check_length(len(chat.token_ids))
        return ProcessedPrompt(chat.token_ids, chat.text)

    def check_size(self, field: str, num_bytes: int) -> None:
        """Refuses text whose size alone says it cannot fit (see
        ``max_prompt_bytes``)."""
        if num_bytes > self.max_prompt_bytes:
            raise InvalidRequestError(
                field,
                f"has {num_bytes} bytes of text; the limit is max_model_len - 1 = "
                f"{self.max_model_len - 1} tokens, which no text over "
                f"{self.max_prompt_bytes} bytes fits in (a token is at most "
                f"{self.max_token_bytes} bytes)",
            )

    def check_length(self, num_tokens: int) -> None:
        """Refuses a prompt of ``max_model_len`` tokens or more."""
        if num_tokens >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"has {num_tokens} tokens; the limit is max_model_len - 1 = "
                f"{self.max_model_len - 1} (room for at least one generated token)",
            )

    def _check_vocab(self, field: str, token_ids: list[int]) -> None:
        for i, t in enumerate(token_ids):
            if not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    field,
                    f"token id {t!r} is outside the vocabulary [0, {self.vocab_size})",
                    index=i,
                )

    def make_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        options: RequestOptions | None = None,
        *,
        arrival_time: float | None = None,
    ) -> Request:
        """``prompt`` was checked when it was made (``process_*``);
        ``options`` (None: the defaults) are checked here, naming their
        fields, and reach the ``Request`` unchanged: ``lora_name`` must
        name a loaded adapter (None or "": the base model)."""
        options = options or RequestOptions()
        lora_request = self.loras.resolve(options.lora_name)
        _check_options(options, len(prompt.token_ids))
        _check_prompt_logprobs(params, options.kv_transfer_params)
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise InvalidRequestError(
                "stop_token_ids", f"{bad_stop} are outside the vocabulary [0, {self.vocab_size})"
            )
        bad_bias = sorted(t for t in params.logit_bias if not 0 <= t < self.vocab_size)
        if bad_bias:
            raise InvalidRequestError(
                "logit_bias",
                f"token ids {bad_bias} are outside the vocabulary [0, {self.vocab_size})",
            )
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            options=options,
            lora_request=lora_request,
        )


def _check_not_empty(field: str, value: str | list[int]) -> None:
    if not value:
        raise InvalidRequestError(field, "is empty")


def _check_options(options: RequestOptions, num_prompt_tokens: int) -> None:
    if not isinstance(options.priority, int) or isinstance(options.priority, bool):
        raise InvalidRequestError("priority", f"must be an int, got {options.priority!r}")
    salt = options.cache_salt
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequestError("cache_salt", f"must be a non-empty string or None, got {salt!r}")
    _check_output_in_prompt(options.num_output_tokens_in_prompt, num_prompt_tokens)


def _check_output_in_prompt(count: int, num_prompt_tokens: int) -> None:
    """The output tokens said to end the prompt must be in it."""
    if not isinstance(count, int) or isinstance(count, bool):
        raise InvalidRequestError("num_output_tokens_in_prompt", f"must be an int, got {count!r}")
    if not 0 <= count <= num_prompt_tokens:
        raise InvalidRequestError(
            "num_output_tokens_in_prompt",
            f"must be between 0 and the prompt's {num_prompt_tokens} tokens, got {count}",
        )


def _check_prompt_logprobs(params: SamplingParams, kv_params: KVTransferParams | None) -> None:
    """A decode leg loads its prompt's KV from a prefill pod, so it never
    computes the logits that prompt logprobs come from."""
    if params.prompt_logprobs is not None and kv_params is not None and kv_params.do_remote_prefill:
        raise InvalidRequestError(
            "prompt_logprobs",
            "cannot be asked of a request whose prompt KV comes from a prefill pod "
            "(kv_transfer_params.do_remote_prefill): this pod never computes the prompt; "
            "ask the prefill leg for them",
        )
