"""One request's structured-output state, as the scheduler sees it (no torch)."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass

from engine.structured_output.backend import CompiledGrammar, Grammar
from engine.structured_output.params import StructuredOutputParams


class GrammarState(enum.Enum):
    COMPILING = enum.auto()
    READY = enum.auto()
    FAILED = enum.auto()


@dataclass(eq=False)
class StructuredOutputRequest:
    """``compiled`` is the pool's future (shared with every request of the
    same key); ``grammar`` this request's matcher once it is ready; ``error``
    why it never will be (the backend's message)."""

    params: StructuredOutputParams
    compiled: Future[CompiledGrammar] | None = None
    grammar: Grammar | None = None
    error: str | None = None

    @property
    def field(self) -> str:
        """The request field the constraint came in (errors name it)."""
        return f"structured_outputs.{self.params.kind.value}"
