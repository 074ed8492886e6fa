"""Incremental detokenization and stop strings for one request.

Each step decodes only a short window of tokens: ``decode(ids[prefix:])``
minus ``decode(ids[prefix:read])`` is the text the tokens after ``read``
add. The window starts one emission back so that tokenizers which change a
token's text at the start of a string (SentencePiece drops the leading
space) see the same start in both decodes. Text ending in U+FFFD is an
incomplete UTF-8 character (byte-level tokens split multi-byte characters)
and is held back until a later token completes it, or ``finish`` flushes it.

Stop strings are searched only where a new match can be: a match must end
in the text this update added. Streaming deltas hold back any tail that is
the start of a stop string, so no text that a later match would cut is
ever emitted. With ``include_stop_str_in_output`` a match cuts the text
after the stop string instead, and nothing is held back: a match can only
cut text that ends in it, which was not sent yet.

Resuming (prefill/decode handover): an output may have begun in an earlier
leg whose tokens now end this request's prompt. Those tokens are replayed
first, one per step as that leg generated them, without stop matching (a
match ending in them would have ended that leg), and what that leg's
stream sent for them, the same deltas computed the same way, is marked as
sent. A stop string may then begin in their text, and the deltas continue
that leg's stream exactly: together they are one output's stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase, TokenizersBackend

from engine.sampling_params import SamplingParams

_INCOMPLETE = "\ufffd"

Decode = Callable[[list[int]], str]


def make_decode(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> Decode:
    """A ``list[int] -> str`` decode equal to ``tokenizer.decode``.

    For a tokenizers-backed tokenizer that neither overrides ``_decode`` nor
    cleans up spaces, ``decode`` is exactly the Rust decode plus ~10 us of
    Python dispatch per call; the detokenizer decodes twice per token, so
    it calls the Rust tokenizer directly.
    """
    if (
        isinstance(tokenizer, TokenizersBackend)
        and type(tokenizer)._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        backend = tokenizer.backend_tokenizer

        def fast_decode(token_ids: list[int]) -> str:
            return backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

        return fast_decode

    def decode(token_ids: list[int]) -> str:
        text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        if not isinstance(text, str):  # only a batch of sequences decodes to a list
            raise TypeError(f"tokenizer.decode returned {type(text).__name__}, expected str")
        return text

    return decode


@dataclass
class _DecodeWindow:
    """Tokens so far and the window offsets (indices into ``token_ids``)."""

    token_ids: list[int] = field(default_factory=list)
    # Start of the decode window: where the last emission's window began.
    prefix_offset: int = 0
    # Tokens before this have had their text emitted.
    read_offset: int = 0
    # decode(token_ids[prefix_offset:read_offset]), cached between steps.
    prefix_text: str = ""


@dataclass
class _StopState:
    """Text so far and what streaming and stop matching have done with it."""

    text: str = ""
    # Chars of ``text`` already returned by get_next_delta.
    sent: int = 0
    finished: bool = False
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, step by step.

    The final text equals ``tokenizer.decode(output_ids, skip_special_tokens)``
    when no stop string matched. ``prompt_token_ids`` is deliberately not
    used as decode context: context would change the text of the first
    output token (a SentencePiece leading space, a prompt ending
    mid-character), and the output is defined as the decode of the output
    tokens alone.

    ``num_output_tokens_in_prompt``: the prompt's last this-many tokens
    began the output in an earlier leg (see the module docstring). The
    output's text then starts with theirs; ``min_tokens`` and
    ``output_token_ids`` count only the tokens passed to ``update``.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
        skip_special_tokens: bool = True,
        num_output_tokens_in_prompt: int = 0,
    ) -> None:
        self._decode = make_decode(tokenizer, skip_special_tokens)
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        # First chars of the stops: a cheap filter for the hold-back scan.
        self._stop_starts = frozenset(s[0] for s in self._stops)
        self._min_tokens = params.min_tokens
        self._window = _DecodeWindow()
        self._state = _StopState()
        self._num_resumed = 0
        if num_output_tokens_in_prompt > 0:
            self._resume(prompt_token_ids[-num_output_tokens_in_prompt:])

    @property
    def output_text(self) -> str:
        """All text decoded so far (a matched stop string cuts it: see ``update``)."""
        return self._state.text

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens passed to ``update`` (not the resumed ones)."""
        return self._window.token_ids[self._num_resumed :]

    @property
    def finished(self) -> bool:
        return self._state.finished

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._state.stop_string

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string they completed, if any.

        On a match the text is cut right before the stop string (right
        after it with ``include_stop_str_in_output``) and the detokenizer
        is finished: the caller stops the request.
        """
        if self._state.finished:
            raise RuntimeError(
                f"update({new_token_ids!r}): detokenizer already finished "
                f"(stop string {self._state.stop_string!r})"
            )
        self._window.token_ids.extend(new_token_ids)
        return self._append_text(self._decode_new_text())

    def update_until_stop(self, new_token_ids: list[int]) -> tuple[str | None, list[int]]:
        """``update`` for a step that yields several tokens (accepted
        drafts): a token at a time while stop strings are set, so a match
        ends the tokens where a one-token-a-step run would have ended them.
        Returns the stop string (or None) and the tokens taken."""
        if len(new_token_ids) <= 1 or not self._stops:
            return self.update(new_token_ids), new_token_ids
        for taken, token_id in enumerate(new_token_ids, 1):
            stop = self.update([token_id])
            if stop is not None:
                return stop, new_token_ids[:taken]
        return None, new_token_ids

    def finish(self) -> str | None:
        """End the output (EOS, length, abort): flush held-back text.

        Incomplete characters are emitted as U+FFFD, as a full decode would.
        Returns a stop string if the flushed text completes one. Calling it
        again is a no-op.
        """
        if self._state.finished:
            return None
        window = self._window
        full = self._decode(window.token_ids[window.prefix_offset :])
        stop = self._append_text(full[len(window.prefix_text) :])
        self._state.finished = True
        return stop

    def get_next_delta(self) -> str:
        """Text not returned yet that no later stop match can remove."""
        state = self._state
        end = len(state.text)
        if not state.finished:
            end -= self._held_back_len()
        if end <= state.sent:
            return ""
        delta = state.text[state.sent : end]
        state.sent = end
        return delta

    # ------------------------------------------------------------------

    def _resume(self, token_ids: list[int]) -> None:
        """Replay an earlier leg's output tokens as that leg's detokenizer
        saw them (one per step) and mark the deltas it streamed as sent."""
        for token_id in token_ids:
            self._window.token_ids.append(token_id)
            self._state.text += self._decode_new_text()
            self.get_next_delta()  # that leg's client has this already
        self._num_resumed = len(token_ids)

    def _decode_new_text(self) -> str:
        """Text the tokens after ``read_offset`` add, or "" while it is
        incomplete (or empty: skipped special tokens add nothing)."""
        window = self._window
        full = self._decode(window.token_ids[window.prefix_offset :])
        prefix_len = len(window.prefix_text)
        if len(full) <= prefix_len or full.endswith(_INCOMPLETE):
            return ""
        window.prefix_offset = window.read_offset
        window.read_offset = len(window.token_ids)
        window.prefix_text = self._decode(window.token_ids[window.prefix_offset :])
        return full[prefix_len:]

    def _append_text(self, new_text: str) -> str | None:
        state = self._state
        start = len(state.text)
        state.text += new_text
        # min_tokens: like stop tokens, no stop string ends the output
        # before that many tokens exist.
        num_generated = len(self._window.token_ids) - self._num_resumed
        if not new_text or num_generated < self._min_tokens:
            return None
        match = self._find_stop(start)
        if match is None:
            return None
        index, stop = match
        state.text = state.text[: index + len(stop) if self._include_stop else index]
        state.finished = True
        state.stop_string = stop
        return stop

    def _find_stop(self, new_text_start: int) -> tuple[int, str] | None:
        """Earliest stop occurrence that ends in the new text; on a tie at
        the same index, the stop listed first."""
        text = self._state.text
        best: tuple[int, str] | None = None
        for stop in self._stops:
            # Matches ending before new_text_start were searched already.
            index = text.find(stop, max(0, new_text_start - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _held_back_len(self) -> int:
        """Length of the longest unsent tail that begins some stop string.

        Such a tail could still become a match. A proper prefix of a stop is
        at most ``max_stop_len - 1`` chars. Sent text needs no check: it was
        sent because, then, no tail reaching back to it began a stop, and a
        future match must end in future text, so it would begin such a tail.
        """
        if self._include_stop:
            return 0
        text = self._state.text
        longest = min(self._max_stop_len - 1, len(text) - self._state.sent)
        for length in range(longest, 0, -1):
            tail_start = len(text) - length
            if text[tail_start] not in self._stop_starts:
                continue
            tail = text[tail_start:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
