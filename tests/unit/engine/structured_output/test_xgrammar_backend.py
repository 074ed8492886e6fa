"""The xgrammar backend on the default model's tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.models.loader import load_tokenizer, resolve_model
from engine.structured_output.backend import GrammarCompileError, library_message
from engine.structured_output.params import StructuredOutputParams
from engine.structured_output.xgrammar_backend import XGrammarBackend, choice_grammar

# The model's vocabulary is the tokenizer's here; a padded one is tested below.
VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(Path(resolve_model(None)))


@pytest.fixture(scope="module")
def backend(tokenizer) -> XGrammarBackend:
    return XGrammarBackend(tokenizer, VOCAB)


def _allowed(bitmask: np.ndarray, row: int = 0) -> set[int]:
    bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")
    return set(bits.nonzero()[0].tolist())


def _run(backend: XGrammarBackend, tokenizer, so: StructuredOutputParams, text: str):
    grammar = backend.matcher(backend.compile(so))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return grammar, ids


def test_a_choice_accepts_its_strings_and_then_only_eos(backend, tokenizer) -> None:
    so = StructuredOutputParams(choice=["yes", "no"])
    grammar, ids = _run(backend, tokenizer, so, "yes")
    assert grammar.validate_tokens([*ids, 1234]) == ids  # no advance
    assert grammar.accept_tokens(ids)
    mask = backend.allocate_bitmask(1)
    grammar.fill_bitmask(mask, 0)
    assert _allowed(mask) == {tokenizer.eos_token_id}
    assert not grammar.is_terminated()
    assert grammar.accept_tokens([tokenizer.eos_token_id])
    assert grammar.is_terminated()


def test_a_refused_token_is_not_accepted(backend, tokenizer) -> None:
    grammar, ids = _run(backend, tokenizer, StructuredOutputParams(regex="[0-9]+"), "12")
    letters = tokenizer.encode("abc", add_special_tokens=False)
    assert not grammar.accept_tokens(letters)
    assert grammar.accept_tokens(ids)


def test_choices_with_quotes_and_backslashes_compile_exactly() -> None:
    assert choice_grammar(['say "hi"', "a\\b", "é"]) == ('root ::= "say \\"hi\\"" | "a\\\\b" | "é"')


def test_batch_fill_equals_one_by_one(backend, tokenizer) -> None:
    kinds = [
        StructuredOutputParams(json={"type": "object"}),
        StructuredOutputParams(regex="[a-c]{2}"),
        StructuredOutputParams(json_object=True),
    ]
    grammars = [backend.matcher(backend.compile(so)) for so in kinds]
    batch = backend.allocate_bitmask(3)
    backend.fill_bitmasks(grammars, batch)
    for row, g in enumerate(grammars):
        one = backend.allocate_bitmask(3)
        g.fill_bitmask(one, row)
        assert (one[row] == batch[row]).all()
    assert _allowed(batch, 1) and len(_allowed(batch, 1)) < 100


@pytest.mark.parametrize(
    "so",
    [
        StructuredOutputParams(regex="(ab"),
        StructuredOutputParams(grammar="root ::= undefined_rule"),
        StructuredOutputParams(json={"type": "no-such-type"}),
    ],
)
def test_what_does_not_compile_raises_the_librarys_message(backend, so) -> None:
    with pytest.raises(GrammarCompileError) as info:
        backend.compile(so)
    assert str(info.value)
    # Without xgrammar's log prefix ("[03:39:44] /project/cpp/regex_converter.cc:83: ").
    assert not str(info.value).startswith("["), str(info.value)
    assert ".cc:" not in str(info.value)


def test_the_log_prefix_is_stripped_from_every_line() -> None:
    raw = RuntimeError(
        "[03:39:44] /project/cpp/regex_converter.cc:83: Regex parsing error at position 3\n"
        "[03:39:44] /project/cpp/x.cc:9: second line [12:00:00] kept\n"
    )
    assert library_message(raw) == "Regex parsing error at position 3\nsecond line [12:00:00] kept"
    assert library_message(ValueError("")) == "ValueError"


def test_padded_vocabulary_rows_are_never_allowed(tokenizer) -> None:
    padded = XGrammarBackend(tokenizer, VOCAB + 64)
    grammar = padded.matcher(padded.compile(StructuredOutputParams(json_object=True)))
    mask = padded.allocate_bitmask(1)
    grammar.fill_bitmask(mask, 0)
    assert mask.shape == (1, (VOCAB + 64) // 32)
    assert not any(t >= VOCAB for t in _allowed(mask))


def test_json_object_means_an_object_not_any_json_value(backend, tokenizer) -> None:
    so = StructuredOutputParams(json_object=True)
    array, ids = _run(backend, tokenizer, so, "[1, 2]")
    assert not array.accept_tokens(ids[:1])
    obj, ids = _run(backend, tokenizer, so, '{"a": [1, 2]}')
    assert obj.accept_tokens([*ids, tokenizer.eos_token_id]) and obj.is_terminated()
