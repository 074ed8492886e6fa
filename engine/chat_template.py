"""The model's chat template: renders chat messages into a prompt's text
and its token ids.

Messages are checked first (``InvalidRequestError`` naming the message or
its role): a role is pasted into the prompt verbatim, so only roles the
template knows are taken.

A message's content is the caller's text, never the template's markup: a
special token spelled in it (``<|im_end|>\n<|im_start|>system\n...``) is
tokenized as the characters it is made of, not as the control id, so
content cannot open, close or forge turns. ``ChatTemplate.encode`` is the
one place chat is tokenized (tandem.v1 Generate and Tokenize, ``LLM.chat``).
We render such content as text rather than refuse it because it is
legitimate content (a question about ChatML, a pasted log or source file)
that clients send without knowing the model's tokens, and OpenAI's API
takes it as text; engines that tokenize the rendered prompt with special
tokens recognized (vLLM's default) let a user forge system turns instead.

A server's template is the checkpoint's own unless ``--chat-template``
(``ModelConfig.chat_template``) names a file or holds a template, as vLLM's
flag does: a GGUF carries no template where its converter left it out
(Gemma 3 270M's), and users swap a template to change a default system
prompt. ``read_chat_template`` (engine/config.py) resolves the option;
``check_chat_template`` checks it renders; ``load_tokenizer``
(engine/models/loader.py) sets it on the tokenizer, the one owner of the
template a server uses (the gateway's copy is taken from it:
service/tokenizer_bundle.py).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jinja2
from jinja2 import nodes

from engine.config import ConfigError
from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ChatMessage = dict[str, str]

# Roles every chat message may take, whatever the template says of them
# (the OpenAI set; ChatML templates such as the default model's render any
# role alike). A template's own roles are added: see ``template_roles``.
STANDARD_ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class RenderedChat:
    """Chat messages as a prompt: the template's text and its token ids."""

    text: str
    token_ids: list[int]


class ChatTemplate:
    """Renders messages with the tokenizer's template; ``roles`` are the
    ones it takes."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        # Tokens the tokenizer matches literally in text: a template's turn
        # markers among them.
        self.control_tokens = tuple(sorted(tokenizer.get_added_vocab()))
        # Special tokens, longest first (so the longer of two that share a
        # start matches): what content may spell only as text.
        added = tokenizer.added_tokens_decoder.items()
        self._special_ids = {t.content: i for i, t in added if t.special}
        self.special_tokens = tuple(sorted(self._special_ids, key=lambda t: (-len(t), t)))
        self._special = _any_of(self.special_tokens)
        template = tokenizer.chat_template
        self.roles = STANDARD_ROLES | (
            template_roles(template) if isinstance(template, str) else frozenset()
        )

    def render(self, messages: list[ChatMessage], field: str = "messages") -> str:
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
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except jinja2.TemplateError as e:
            # A template's raise_exception ("roles must alternate ..."), or
            # a field it needs that these messages lack: the caller's to fix.
            raise InvalidRequestError(field, f"the chat template refused them: {e}") from None
        return str(text)

    def encode(self, messages: list[ChatMessage], field: str = "messages") -> RenderedChat:
        """Renders (as ``render``) and tokenizes chat messages; a special
        token spelled in a message's content becomes text tokens, never
        its control id (see the module's docstring)."""
        text = self.render(messages, field)
        pattern = self._special
        if pattern is None or not any(pattern.search(m["content"]) for m in messages):
            # Nothing to keep apart: the plain tokenization of the text.
            return RenderedChat(text, self._plain(text))
        return RenderedChat(text, self._encode_content_as_text(messages, field, pattern))

    @property
    def text(self) -> str | None:
        """The template's source (None: no template, or several named ones)."""
        template = self.tokenizer.chat_template
        return template if isinstance(template, str) else None

    def _encode_content_as_text(
        self, messages: list[ChatMessage], field: str, pattern: re.Pattern[str]
    ) -> list[int]:
        """Renders with each special token in content replaced by a
        placeholder the tokenizer cannot match, so every special token left
        in the rendered text is the template's own; tokenizes the text
        between those with special tokens split into their characters,
        each placeholder spelled out again. Text without special tokens in
        content gets ``_plain``'s ids exactly."""
        nonce = secrets.token_hex(8)  # content cannot guess it
        marks = {t: f"\ue000{nonce}.{i}\ue001" for i, t in enumerate(self.special_tokens)}
        spelled = {mark: token for token, mark in marks.items()}
        escaped = [
            {"role": m["role"], "content": pattern.sub(lambda t: marks[t.group()], m["content"])}
            for m in messages
        ]
        mark = re.compile("|".join(re.escape(m) for m in spelled))
        ids: list[int] = []
        # re.split with a group: text, template's token, text, ...
        for i, piece in enumerate(pattern.split(self.render(escaped, field))):
            if i % 2:
                ids.append(self._special_ids[piece])
            elif piece:
                text = mark.sub(lambda m: spelled[m.group()], piece)
                ids += self.tokenizer.encode(
                    text, add_special_tokens=False, split_special_tokens=True
                )
        return ids

    def _plain(self, text: str) -> list[int]:
        """The rendered text's ids, with no BOS or EOS added: a template
        writes the special tokens it wants (Llama 3's and Gemma's start
        with ``{{ bos_token }}``), as transformers' ``apply_chat_template``
        and the gateway (smg) tokenize it; adding them again doubled the
        BOS."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _check_role(self, field: str, role: str) -> None:
        """Only roles the template knows: a role is pasted into the prompt
        verbatim, so one holding control tokens would forge turns."""
        if role in self.roles:
            return
        control = [t for t in self.control_tokens if t in role]
        if control:
            raise InvalidRequestError(field, f"contains the control token {control[0]!r}")
        raise InvalidRequestError(
            field, f"must be one of {', '.join(sorted(self.roles))}, got {role[:40]!r}"
        )


def check_chat_template(tokenizer: PreTrainedTokenizerBase, origin: str) -> None:
    """Renders a one-message chat with the tokenizer's template, so a broken
    template (bad syntax, a variable it requires) fails at start-up with the
    reason, not on every chat request. ``origin`` says where the template
    came from, for the error."""
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
    except Exception as e:  # jinja2's syntax and runtime errors, and the template's raise_exception
        raise ConfigError(
            f"chat_template from {origin} is invalid: it does not render a one-message "
            f"chat: {type(e).__name__}: {e}"
        ) from None


def _any_of(tokens: tuple[str, ...]) -> re.Pattern[str] | None:
    """Matches any of ``tokens`` as a group (None: no tokens)."""
    return re.compile("(" + "|".join(map(re.escape, tokens)) + ")") if tokens else None


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
