"""The model's chat template: renders chat messages into a prompt's text.

Messages are checked first (``InvalidRequestError`` naming the message or
its role): a role is pasted into the prompt verbatim, so only roles the
template knows are taken.
"""

from __future__ import annotations

import jinja2
from jinja2 import nodes
from transformers import PreTrainedTokenizerBase

from engine.errors import InvalidRequestError

ChatMessage = dict[str, str]

# Roles every chat message may take, whatever the template says of them
# (the OpenAI set; ChatML templates such as the default model's render any
# role alike). A template's own roles are added: see ``template_roles``.
STANDARD_ROLES = frozenset({"system", "user", "assistant", "tool"})


class ChatTemplate:
    """Renders messages with the tokenizer's template; ``roles`` are the
    ones it takes."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        # Tokens the tokenizer matches literally in text: a template's turn
        # markers among them.
        self.control_tokens = tuple(sorted(tokenizer.get_added_vocab()))
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
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return str(text)

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
