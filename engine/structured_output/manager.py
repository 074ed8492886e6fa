"""StructuredOutputManager: compiles grammars off the engine thread and
fills each step's bitmask.

Compilation runs in a small thread pool (xgrammar releases the GIL while
it compiles), one future per constraint key, kept in an LRU cache: a
second request with the same schema is ready at once. The backend itself
(its tokenizer info: a pass over the vocabulary) is built in the pool too,
on the first constrained request, so a server that never sees one never
pays for it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.structured_output.backend import (
    CompiledGrammar,
    Grammar,
    GrammarBackend,
    GrammarCompileError,
    library_message,
)
from engine.structured_output.request import GrammarState, StructuredOutputRequest

if TYPE_CHECKING:
    from engine.request import Request
    from engine.structured_output.backend import Bitmask

logger = logging.getLogger(__name__)


@dataclass
class GrammarBitmask:
    """One step's masks, in ``req_ids`` order: ``rows_per_req[i]``
    consecutive rows for request i (one per position it samples at: its
    drafts', then the one after them); None: one row each."""

    req_ids: list[str]
    bitmask: Bitmask
    rows_per_req: list[int] | None = None

    def row_spans(self) -> list[tuple[int, int]]:
        """(first bitmask row, number of rows) of each request."""
        counts = self.rows_per_req or [1] * len(self.req_ids)
        spans, at = [], 0
        for count in counts:
            spans.append((at, count))
            at += count
        return spans


class StructuredOutputManager:
    CACHE_SIZE = 256

    def __init__(self, make_backend: Callable[[], GrammarBackend], max_workers: int = 2) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="tandem-grammar")
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()

    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's constraint (or find it compiled)."""
        so = request.structured_output_request
        assert so is not None
        key = so.params.key
        future = self._cache.get(key)
        if future is None:
            params = so.params
            future = self._pool.submit(lambda: self.backend().compile(params))
            self._cache[key] = future
            if len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        so.compiled = future

    def activate(self, request: Request) -> GrammarState:
        """For a request in WAITING_FOR_FSM: READY once its grammar compiled
        (its matcher made, and advanced past any output an earlier leg
        generated: a P/D decode leg's prompt ends with the prefill's
        token); FAILED with ``error`` set if it cannot be."""
        so = request.structured_output_request
        assert so is not None and so.compiled is not None
        if so.grammar is not None:
            return GrammarState.READY
        if not so.compiled.done():
            return GrammarState.COMPILING
        exc = so.compiled.exception()
        if exc is not None:
            so.error = str(exc) if isinstance(exc, GrammarCompileError) else repr(exc)
            return GrammarState.FAILED
        grammar = self.backend().matcher(so.compiled.result())
        earlier = request.num_output_tokens_in_prompt
        replay = (
            request.prompt_token_ids[len(request.prompt_token_ids) - earlier :] if earlier else []
        )
        replay += request.output_token_ids
        if replay and not grammar.accept_tokens(replay):
            so.error = f"the tokens generated so far {replay} do not fit the grammar"
            return GrammarState.FAILED
        so.grammar = grammar
        return GrammarState.READY

    def grammar_bitmask(
        self, requests: Sequence[Request], drafts: dict[str, list[int]] | None = None
    ) -> GrammarBitmask:
        """One row per request (each READY), in order; a request verifying
        drafts (``drafts``, already validated) gets a row per draft first,
        each after the drafts before it. A request whose grammar fails here
        gets rows that allow every token and its ``failure`` set: it ends
        with an error when this step's tokens come back, alone."""
        req_ids = [r.request_id for r in requests]
        if not drafts or not any(rid in drafts for rid in req_ids):
            bitmask = self.backend().allocate_bitmask(len(requests))
            self._fill_plain(requests, bitmask)
            return GrammarBitmask(req_ids, bitmask)
        counts = [len(drafts.get(rid, ())) + 1 for rid in req_ids]
        bitmask = self.backend().allocate_bitmask(sum(counts))
        row = 0
        for request, count in zip(requests, counts, strict=True):
            _fill_guarded(_ready(request), drafts.get(request.request_id, []), bitmask, row)
            row += count
        return GrammarBitmask(req_ids, bitmask, counts)

    def _fill_plain(self, requests: Sequence[Request], bitmask: Bitmask) -> None:
        """One row each, in one batch call; if that fails, row by row, so
        that only the failing request pays."""
        grammars = [g for r in requests if (g := _ready(r).grammar) is not None]
        try:
            self.backend().fill_bitmasks(grammars, bitmask)
            return
        except Exception:
            logger.exception("batched grammar mask failed; filling row by row")
        bitmask.fill(-1)
        for row, request in enumerate(requests):
            _fill_guarded(_ready(request), [], bitmask, row)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _ready(request: Request) -> StructuredOutputRequest:
    so = request.structured_output_request
    assert so is not None and so.grammar is not None
    return so


def _fill_guarded(
    so: StructuredOutputRequest, drafts: list[int], bitmask: Bitmask, row: int
) -> None:
    """``_fill_with_drafts`` for one request; on any error its rows allow
    every token and the failure is recorded (the request alone ends)."""
    try:
        _fill_with_drafts(so.grammar, drafts, bitmask, row)
    except Exception as exc:
        logger.error("grammar mask failed for a request: %s", exc)
        so.failure = f"the grammar failed: {library_message(exc)}"
        bitmask[row : row + len(drafts) + 1] = -1


def _fill_with_drafts(
    grammar: Grammar | None, drafts: list[int], bitmask: Bitmask, row: int
) -> None:
    """Rows ``row ..``: the mask before each draft and after the last; the
    grammar ends where it began. A draft that completes the grammar (its
    stop token) leaves the rows after it allowing every token: whatever is
    sampled there is dropped (``StructuredOutputRequest.advance``), and a
    completed grammar has no next-token mask to ask for."""
    assert grammar is not None
    grammar.fill_bitmask(bitmask, row)
    accepted = 0
    for token in drafts:
        if not grammar.accept_tokens([token]):
            raise RuntimeError(f"grammar refused draft token {token} it had validated")
        accepted += 1
        if grammar.is_terminated():
            break
        grammar.fill_bitmask(bitmask, row + accepted)
    if accepted:
        grammar.rollback(accepted)


__all__ = ["GrammarBitmask", "StructuredOutputManager", "StructuredOutputRequest"]
