"""The scheduler's structured-output path (WAITING_FOR_FSM, bitmasks,
grammar advance and end, drafts) with a grammar backend double: a grammar
that allows exactly SEQUENCE then EOS, and a compile the test holds back."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from engine.errors import InvalidRequestError
from engine.outputs import DraftTokenIds
from engine.request import FinishReason, Request, RequestStatus
from engine.request_options import RequestOptions
from engine.sched.grammars import SchedulerGrammars
from engine.sched.scheduler import Scheduler
from engine.structured_output.backend import (
    CompiledGrammar,
    Grammar,
    GrammarCompileError,
)
from engine.structured_output.manager import StructuredOutputManager
from engine.structured_output.params import StructuredOutputParams
from tests.unit.engine.sched.harness import (
    EOS,
    free_blocks,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)

if TYPE_CHECKING:
    from engine.structured_output.backend import Bitmask

VOCAB = 2048
SEQUENCE = [1001, 1002, 1003]
REGEX = StructuredOutputParams(regex="a+")


class SequenceGrammar:
    """Allows SEQUENCE, then EOS (which completes it)."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def _next(self, accepted: list[int]) -> int | None:
        order = [*SEQUENCE, EOS]
        return order[len(accepted)] if len(accepted) < len(order) else None

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for t in token_ids:
            if t != self._next(self.accepted):
                return False
            self.accepted.append(t)
        return True

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        trial = list(self.accepted)
        for i, t in enumerate(token_ids):
            if t != self._next(trial):
                return token_ids[:i]
            trial.append(t)
        return token_ids

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens :]

    def fill_bitmask(self, bitmask: Bitmask, row: int) -> None:
        if self.is_terminated():  # as xgrammar: a completed grammar has no next mask
            raise RuntimeError("GrammarMatcher has terminated after accepting the stop token")
        bitmask[row] = 0
        nxt = self._next(self.accepted)
        if nxt is not None:
            bitmask[row, nxt // 32] = np.int32(np.uint32(1 << (nxt % 32)).view(np.int32))

    def is_terminated(self) -> bool:
        return self._next(self.accepted) is None


class Backend:
    """Compiles to a token: at once, once `gate` is set, or fails."""

    vocab_size = VOCAB

    def __init__(self, *, gate: threading.Event | None = None, error: str | None = None) -> None:
        self.gate = gate
        self.error = error
        self.compiled: list[StructuredOutputParams] = []

    def compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        if self.gate is not None:
            assert self.gate.wait(30)
        if self.error is not None:
            raise GrammarCompileError(self.error)
        self.compiled.append(params)
        return object()

    def matcher(self, compiled: CompiledGrammar) -> Grammar:
        return SequenceGrammar()

    def allocate_bitmask(self, rows: int) -> Bitmask:
        return np.full((rows, (VOCAB + 31) // 32), -1, dtype=np.int32)

    def fill_bitmasks(self, grammars: list[Grammar], bitmask: Bitmask) -> None:
        for row, g in enumerate(grammars):
            g.fill_bitmask(bitmask, row)


def _scheduler(backend: Backend, **kwargs: Any) -> Scheduler:
    sched = make_scheduler(**kwargs)
    sched.grammars = SchedulerGrammars(StructuredOutputManager(lambda: backend))
    return sched


def _constrained(rid: str, prompt: list[int] | int = 8, **kwargs: Any) -> Request:
    return make_request(rid, prompt, structured_outputs=REGEX, **kwargs)


def _grammar(request: Request) -> SequenceGrammar:
    so = request.structured_output_request
    assert so is not None and isinstance(so.grammar, SequenceGrammar)
    return so.grammar


def _follow(request: Request) -> int:
    """A model that samples what the grammar allows (the runner's mask)."""
    grammar = _grammar(request)
    nxt = grammar._next(grammar.accepted)
    assert nxt is not None
    return nxt


def _wait_compiled(request) -> None:
    request.structured_output_request.compiled.exception(timeout=30)


def test_a_compiling_grammar_waits_without_holding_up_the_queue() -> None:
    gate = threading.Event()
    sched = _scheduler(Backend(gate=gate))
    slow, free = _constrained("r1"), make_request("r2", 8, max_tokens=8)
    sched.add_request(slow)
    sched.add_request(free)
    assert slow.status is RequestStatus.WAITING_FOR_FSM
    for _ in range(3):  # the compile is held: steps go on without it
        res = step(sched)
        assert list(res.scheduled) == ["r2"]
        assert slow.status is RequestStatus.WAITING_FOR_FSM
        assert res.sched_out.grammar_bitmask is None
    gate.set()
    _wait_compiled(slow)
    res = step(sched, _follow_or_default)
    assert res.scheduled == {"r2": 1, "r1": 8}
    assert slow.status in (RequestStatus.RUNNING,)  # (mypy narrowed it above)


def _follow_or_default(request) -> int:
    return _follow(request) if request.structured_output_request else 1500


def test_the_grammar_drives_the_output_to_its_end_even_with_ignore_eos() -> None:
    for ignore_eos in (False, True):
        sched = _scheduler(Backend())
        req = _constrained("r1", max_tokens=10, ignore_eos=ignore_eos)
        sched.add_request(req)
        _wait_compiled(req)
        tokens: list[int] = []
        for _ in range(10):
            res = step(sched, _follow)
            tokens += res.tokens("r1")
            if res.finished():
                break
        assert tokens == [*SEQUENCE, EOS]
        assert res.finished() == {"r1": "stop"}
        assert req.status is RequestStatus.FINISHED_STOPPED


def test_mask_rows_only_for_constrained_requests_that_sample() -> None:
    """A prompt chunk short of the prompt's end samples nothing: no row."""
    sched = _scheduler(Backend(), max_num_batched_tokens=32)
    long = _constrained("r1", prompt=50)
    sched.add_request(long)
    sched.add_request(make_request("r2", 8))
    _wait_compiled(long)
    first = step(sched, _follow_or_default)
    assert first.scheduled == {"r1": 32}
    assert first.sched_out.grammar_bitmask is None
    second = step(sched, _follow_or_default)
    assert second.scheduled == {"r1": 18, "r2": 8}
    mask = second.sched_out.grammar_bitmask
    assert mask is not None and mask.req_ids == ["r1"]
    allowed = np.unpackbits(mask.bitmask[0].view(np.uint8), bitorder="little").nonzero()[0]
    assert allowed.tolist() == [SEQUENCE[0]]


def test_a_grammar_that_fails_to_compile_ends_only_its_request() -> None:
    sched = _scheduler(Backend(error="unbalanced parenthesis at 3"))
    bad, good = _constrained("r1"), make_request("r2", 8, max_tokens=2)
    sched.add_request(bad)
    sched.add_request(good)
    _wait_compiled(bad)
    res = step(sched)
    (refused,) = [o for o in res.outputs if o.request_id == "r1"]
    assert refused.finish_reason is FinishReason.ERROR
    assert isinstance(refused.error, InvalidRequestError)
    assert refused.error.field == "structured_outputs.regex"
    assert "unbalanced parenthesis at 3" in str(refused.error)
    assert res.scheduled == {"r2": 8}
    while sched.has_unfinished_requests():
        step(sched)
    assert "r1" not in sched.requests
    assert free_blocks(sched) == sched.cache_config.num_usable_blocks


def test_drafts_are_cut_where_the_grammar_refuses() -> None:
    sched = _scheduler(Backend())
    req = _constrained("r1", max_tokens=10)
    sched.add_request(req)
    _wait_compiled(req)
    step(sched, _follow)  # samples SEQUENCE[0]
    sched.update_draft_token_ids(DraftTokenIds(["r1"], [[SEQUENCE[1], 9999, SEQUENCE[2]]]))
    assert req.spec_token_ids == [SEQUENCE[1]]
    sched.update_draft_token_ids(DraftTokenIds(["r1"], [[SEQUENCE[1], SEQUENCE[2]]]))
    assert req.spec_token_ids == [SEQUENCE[1], SEQUENCE[2]]
    assert _grammar(req).accepted == [SEQUENCE[0]]


def test_a_decode_leg_starts_its_grammar_after_the_prefill_token() -> None:
    """P/D: the prompt ends with the prefill pod's (first) output token."""
    sched = _scheduler(Backend())
    req = make_request("r1", [5, 6, 7, SEQUENCE[0]], structured_outputs=REGEX, max_tokens=8)
    req.options = RequestOptions(num_output_tokens_in_prompt=1)
    sched.add_request(req)
    _wait_compiled(req)
    res = step(sched, _follow)
    assert res.tokens("r1") == [SEQUENCE[1]]


def test_preempted_constrained_requests_resume_where_their_grammar_was() -> None:
    """Blocks for two short requests, not for both to grow: one is
    preempted and recomputed; each still follows its grammar to the end."""
    sched = _scheduler(Backend(), block_size=8, num_blocks=4, max_model_len=16)
    reqs = [_constrained(f"r{i}", prompt=7, max_tokens=8) for i in (1, 2)]
    for r in reqs:
        sched.add_request(r)
        _wait_compiled(r)
    tokens: dict[str, list[int]] = {"r1": [], "r2": []}
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        res = step(sched, _follow)
        for rid in tokens:
            tokens[rid] += res.tokens(rid)
    assert sched.num_preemptions > 0
    assert tokens == {"r1": [*SEQUENCE, EOS], "r2": [*SEQUENCE, EOS]}


def test_without_a_backend_a_constrained_request_is_refused() -> None:
    sched = make_scheduler()
    with pytest.raises(ValueError, match="structured_outputs"):
        sched.add_request(_constrained("r1"))


def test_a_token_the_grammar_refuses_ends_the_request_with_an_error() -> None:
    """Unreachable behind the runner's mask; if it ever happened, the
    request must not go on unconstrained."""
    sched = _scheduler(Backend())
    req = _constrained("r1", max_tokens=10)
    sched.add_request(req)
    _wait_compiled(req)
    res = step(sched, lambda r: 1500)  # not SEQUENCE[0]
    assert res.finished() == {"r1": "error"}
    assert req.status is RequestStatus.FINISHED_ERROR
    assert isinstance(req.stop_reason, str) and "refused" in req.stop_reason


def test_a_second_request_with_the_same_constraint_finds_it_compiled() -> None:
    backend = Backend()
    sched = _scheduler(backend)
    first, second = _constrained("r1"), _constrained("r2")
    sched.add_request(first)
    _wait_compiled(first)
    sched.add_request(second)
    assert second.structured_output_request is not None
    assert second.structured_output_request.compiled.done()  # type: ignore[union-attr]
    assert backend.compiled == [REGEX]  # compiled once
    assert step(sched, _follow).scheduled == {"r1": 8, "r2": 8}


def test_a_draft_that_completes_the_grammar_ends_the_request_there() -> None:
    """The stop token drafted mid-run: no mask is asked of the completed
    grammar, and what is sampled after its end is dropped, also with
    ignore_eos (a run without drafts stops at the same token)."""
    for ignore_eos in (False, True):
        sched = _scheduler(Backend())
        req = _constrained("r1", max_tokens=10, ignore_eos=ignore_eos)
        sched.add_request(req)
        _wait_compiled(req)
        first = step(sched, _follow)
        drafts = [*SEQUENCE[1:], EOS, 7]
        sched.update_draft_token_ids(DraftTokenIds(["r1"], [drafts]))
        assert req.spec_token_ids == [*SEQUENCE[1:], EOS]  # nothing after the end
        res = step(sched, lambda r: [*SEQUENCE[1:], EOS, 1234])
        mask = res.sched_out.grammar_bitmask
        assert mask is not None and mask.rows_per_req == [4]
        assert (mask.bitmask[3] == -1).all()  # after the end: every token allowed
        assert first.tokens("r1") + res.tokens("r1") == [*SEQUENCE, EOS]
        assert res.finished() == {"r1": "stop"}


def test_a_grammar_that_fails_mid_run_ends_its_request_alone() -> None:
    """The grammar library raising (a bug in it or in us) is one request's
    error: the step still runs, its neighbours go on, the engine lives."""
    sched = _scheduler(Backend())
    bad, good = _constrained("r1", max_tokens=10), make_request("r2", 8, max_tokens=3)
    sched.add_request(bad)
    sched.add_request(good)
    _wait_compiled(bad)
    step(sched, _follow_or_default)

    def broken(bitmask: Bitmask, row: int) -> None:
        raise RuntimeError("matcher state corrupt")

    _grammar(bad).fill_bitmask = broken  # type: ignore[method-assign]
    res = step(sched, _follow_or_default)
    assert res.finished() == {"r1": "error"}
    assert bad.status is RequestStatus.FINISHED_ERROR
    assert "matcher state corrupt" in str(bad.stop_reason)
    assert res.tokens("r2") == [1500]
    _, reasons, _ = run_to_completion(sched, _follow_or_default)
    assert reasons == {"r2": "length"}
    assert free_blocks(sched) == sched.cache_config.num_usable_blocks


def test_a_grammar_that_raises_while_checking_drafts_fails_only_its_request() -> None:
    sched = _scheduler(Backend())
    req = _constrained("r1", max_tokens=10)
    sched.add_request(req)
    _wait_compiled(req)
    step(sched, _follow)

    def broken(token_ids: list[int]) -> list[int]:
        raise RuntimeError("validate blew up")

    _grammar(req).validate_tokens = broken  # type: ignore[method-assign]
    sched.update_draft_token_ids(DraftTokenIds(["r1"], [[SEQUENCE[1]]]))
    assert req.spec_token_ids == []
    res = step(sched, _follow)
    assert res.finished() == {"r1": "error"}
    assert "validate blew up" in str(req.stop_reason)
