"""One request's structured-output state, as the scheduler sees it (no torch)."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass

from engine.structured_output.backend import CompiledGrammar, Grammar, library_message
from engine.structured_output.params import StructuredOutputParams


class GrammarState(enum.Enum):
    COMPILING = enum.auto()
    READY = enum.auto()
    FAILED = enum.auto()


@dataclass(frozen=True)
class Advance:
    """What a step's tokens did to a grammar: keep the first ``kept``;
    ``ended``: the last kept one completed the grammar (tokens after it,
    sampled at draft positions past the end, are dropped, as a request
    without drafts would have stopped there); ``error``: the request
    cannot go on (a token refused, or the grammar library failed)."""

    kept: int
    ended: bool = False
    error: str | None = None


@dataclass(eq=False)
class StructuredOutputRequest:
    """``compiled`` is the pool's future (shared with every request of the
    same key); ``grammar`` this request's matcher once it is ready; ``error``
    why it never will be (the backend's message); ``failure`` why a ready
    grammar broke while the request ran (it then ends with an error, and
    only it: the engine and other requests go on)."""

    params: StructuredOutputParams
    compiled: Future[CompiledGrammar] | None = None
    grammar: Grammar | None = None
    error: str | None = None
    failure: str | None = None

    @property
    def field(self) -> str:
        """The request field the constraint came in (errors name it)."""
        return f"structured_outputs.{self.params.kind.value}"

    def advance(self, token_ids: list[int]) -> Advance:
        """Feed a step's sampled tokens to the grammar, one by one, up to
        its end."""
        grammar = self.grammar
        assert grammar is not None
        if self.failure is not None:
            return Advance(0, error=self.failure)
        for i, token_id in enumerate(token_ids):
            try:
                if not grammar.accept_tokens([token_id]):
                    # The mask makes this unreachable; never emit it unchecked.
                    return Advance(i, error=f"the grammar refused the sampled token {token_id}")
                if grammar.is_terminated():
                    return Advance(i + 1, ended=True)
            except Exception as exc:  # the library's own failure ends this request only
                self.failure = f"the grammar failed: {library_message(exc)}"
                return Advance(i, error=self.failure)
        return Advance(len(token_ids))
