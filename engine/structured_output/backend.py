"""The small interface a grammar library sits behind.

A ``GrammarBackend`` is built once per model (its tokenizer's vocabulary,
the model's vocabulary size); it compiles constraints into
``CompiledGrammar`` objects (shared, immutable, cached by the manager) and
makes a ``Grammar`` (one request's matcher state) from one. Bitmasks are
int32 arrays of shape [rows, ceil(vocab_size / 32)], bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed (xgrammar's and llguidance's
layout both).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Protocol, TypeAlias

from engine.structured_output.params import StructuredOutputParams

if TYPE_CHECKING:  # the scheduler imports this module: no numpy at run time
    import numpy as np
    import numpy.typing as npt

    Bitmask: TypeAlias = npt.NDArray[np.int32]


class GrammarCompileError(ValueError):
    """The backend could not compile a constraint; the message is its own."""


class CompiledGrammar(Protocol):
    """A compiled constraint, shared by every request with the same key."""


class Grammar(Protocol):
    """One request's position in its grammar."""

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance by ``token_ids``; False (and no advance past the first
        refused one) if the grammar refuses one."""
        ...

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of ``token_ids`` the grammar accepts from
        here, without advancing."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (drafts tried)."""
        ...

    def fill_bitmask(self, bitmask: Bitmask, row: int) -> None:
        """Write the tokens allowed next into row ``row``."""
        ...

    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        ...


class GrammarBackend(Protocol):
    vocab_size: int

    def compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        """Compile (slow: runs in the manager's pool). Raises
        GrammarCompileError with the library's message."""
        ...

    def matcher(self, compiled: CompiledGrammar) -> Grammar:
        """A fresh matcher at the grammar's start (cheap)."""
        ...

    def allocate_bitmask(self, rows: int) -> Bitmask:
        """A bitmask of ``rows`` rows, every token allowed."""
        ...

    def fill_bitmasks(self, grammars: list[Grammar], bitmask: Bitmask) -> None:
        """Row i of ``bitmask`` for ``grammars[i]`` (a batch call may use threads)."""
        ...


# xgrammar's C++ log prefix on its error text: "[03:39:44] /project/cpp/x.cc:83: ".
_LOG_PREFIX = re.compile(r"^\[\d{2}:\d{2}:\d{2}\] \S+:\d+: ", re.MULTILINE)


def library_message(exc: Exception) -> str:
    """The library's own words for a client: its build paths, line numbers
    and clock say nothing to one."""
    return _LOG_PREFIX.sub("", str(exc)).strip() or type(exc).__name__
