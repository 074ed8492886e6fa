"""Checks and tokenizes what a caller asks for, and makes the Request.

Everything a caller can get wrong is caught here, before the request reaches
the scheduler, as an ``InvalidRequestError`` naming the field, so a bad
request never disturbs the ones already running.

Tokenizing costs CPU in proportion to the text (~1 s per MB): text too long
to fit ``max_model_len`` whatever it tokenizes to is refused by its size
first (``max_prompt_bytes``), and the service calls these methods off its
event loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jinja2
from jinja2 import nodes
from transformers import PreTrainedTokenizerBase

from connectors.kv_transfer_params import KVTransferParams
from engine.request import Request
from engine.sampling_params import SamplingParams

ChatMessage = dict[str, str]

# Roles every chat message may take, whatever the template says of them
# (the OpenAI set; ChatML templates such as the default model's render any
# role alike). A template's own roles are added: see ``template_roles``.
STANDARD_ROLES = frozenset({"system", "user", "assistant", "tool"})


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
        # Tokens the tokenizer matches literally in text: a template's turn
        # markers among them.
        self.control_tokens = tuple(sorted(tokenizer.get_added_vocab()))
        template = tokenizer.chat_template
        self.chat_roles = STANDARD_ROLES | (
            template_roles(template) if isinstance(template, str) else frozenset()
        )

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text)
        return ids

    def render_chat(self, messages: list[ChatMessage], field: str = "messages") -> str:
        """Renders chat messages with the model's chat template; ``field``
        names the messages in errors."""
        if not messages:
            raise InvalidRequestError(field, "must hold at least one message")
        for i, message in enumerate(messages):
            if set(message) != {"role", "content"}:
                raise InvalidRequestError(
                    f"{field}[{i}]", f"expected keys role and content, got {sorted(message)}"
                )
            self._check_role(f"{field}[{i}].role", message["role"])
        if self.tokenizer.chat_template is None:
            raise InvalidRequestError(field, "this model has no chat template")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return str(text)

    def _check_role(self, field: str, role: str) -> None:
        """Only roles the template knows: a role is pasted into the prompt
        verbatim, so one holding control tokens would forge turns."""
        if role in self.chat_roles:
            return
        control = [t for t in self.control_tokens if t in role]
        if control:
            raise InvalidRequestError(field, f"contains the control token {control[0]!r}")
        raise InvalidRequestError(
            field, f"must be one of {', '.join(sorted(self.chat_roles))}, got {role[:40]!r}"
        )

    def process_chat(self, messages: list[ChatMessage], field: str = "messages") -> ProcessedPrompt:
        """Chat messages as a prompt: refused by their size before they are
        rendered and tokenized when they cannot fit max_model_len."""
        contents = (m.get("content", "") for m in messages)
        self.check_size(field, sum(len(c.encode("utf-8", "surrogatepass")) for c in contents))
        text = self.render_chat(messages, field)
        return ProcessedPrompt(self.tokenize(text), text)

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

    def process_prompt(self, prompt: str | list[int]) -> ProcessedPrompt:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "is empty")
            self.check_size("prompt", len(prompt.encode("utf-8", "surrogatepass")))
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
        kv_transfer_params: KVTransferParams | None = None,
        arrival_time: float | None = None,
        num_output_tokens_in_prompt: int = 0,
    ) -> Request:
        """``num_output_tokens_in_prompt``: see ``Request`` (the wire field
        of the same name documents the semantics)."""
        num_tokens = len(prompt.token_ids)
        _check_output_in_prompt(num_output_tokens_in_prompt, num_tokens)
        self.check_length(num_tokens)
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


def template_roles(template: str) -> frozenset[str]:
    """The role names a chat template compares a message's role with
    (``message['role'] == 'ipython'``, ``message.role in ['tool', 'ipython']``):
    the roles it renders in its own way, which callers may therefore send."""
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return frozenset()
    roles: set[str] = set()
    for compare in tree.find_all(nodes.Compare):
        if any(_is_role(n) for n in compare.find_all((nodes.Getitem, nodes.Getattr, nodes.Name))):
            roles.update(c.value for c in compare.find_all(nodes.Const) if isinstance(c.value, str))
    roles.discard("role")
    return frozenset(roles)


def _is_role(node: nodes.Node) -> bool:
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "role"
    if isinstance(node, nodes.Getattr):
        return node.attr == "role"
    return isinstance(node, nodes.Name) and node.name == "role"
