"""``--chat-template`` (engine/chat_template.py, engine/models/loader.py):
a file or the template itself replaces the model's; a missing file, an
empty one, or a template that does not render is refused at start-up with
the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from engine.chat_template import ChatTemplate
from engine.config import ConfigError, ModelConfig, read_chat_template
from engine.errors import InvalidRequestError
from engine.models.loader import load_tokenizer

# Turns as "role: content" lines; no special tokens, so its rendering differs
# from the default model's ChatML.
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
HELLO = [{"role": "user", "content": "Hello"}]


def test_the_option_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN)
    assert read_chat_template(str(path)) == PLAIN
    assert read_chat_template(PLAIN) == PLAIN


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("missing.jinja", None, "not a template .* and not a readable file .No such file"),
        ("empty.jinja", "  \n", "the file is empty"),
    ],
)
def test_a_bad_option_is_refused_by_name(
    tmp_path: Path, name: str, content: str | None, reason: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=f"^chat_template='.*{name}' is invalid: {reason}"):
        ModelConfig(chat_template=str(path))


def test_the_template_replaces_the_models(
    default_model_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    own = ChatTemplate(tokenizer).render(HELLO)
    assert own.startswith("<|im_start|>")
    chat = ChatTemplate(load_tokenizer(default_model_path, PLAIN))
    assert chat.text == PLAIN
    assert chat.render(HELLO) == "user: Hello\nassistant:"
    want = tokenizer.encode("user: Hello\nassistant:", add_special_tokens=False)
    assert chat.encode(HELLO).token_ids == want


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        ("{% for m in messages %}{{ m['content'] }}", "TemplateSyntaxError"),
        ("{{ raise_exception('system message required') }}", "system message required"),
    ],
)
def test_a_template_that_does_not_render_is_refused_at_load(
    default_model_path: Path, template: str, reason: str
) -> None:
    with pytest.raises(ConfigError, match=f"does not render a one-message chat: .*{reason}"):
        load_tokenizer(default_model_path, template)


def test_messages_the_template_refuses_are_a_request_error(default_model_path: Path) -> None:
    """A template's own raise_exception (Llama 2's and Mistral's "roles must
    alternate") answers that request with its reason; the server goes on."""
    alternate = (
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ messages[0]['content'] }}"
    )
    chat = ChatTemplate(load_tokenizer(default_model_path, alternate))
    two = [*HELLO, {"role": "user", "content": "again"}]
    with pytest.raises(InvalidRequestError, match="the chat template refused them: one message"):
        chat.encode(two)
    assert chat.render(HELLO) == "Hello"
