"""The scheduler's structured-output path, in one collaborator.

As the seeds have it: a constrained request waits in WAITING_FOR_FSM until
its grammar compiled (in the manager's pool); each step carries one mask
row per constrained request that samples (one per position for a request
verifying drafts); sampled tokens advance its grammar, and drafts are cut
to what its grammar accepts. A grammar that completes ends its request
("stop"); one that cannot compile ends it with an error naming the field;
one that breaks while the request runs ends that request alone, with an
error, never the engine.

The scheduler keeps the queues and the step; this keeps the grammars.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from engine.request import Request
from engine.structured_output.backend import library_message
from engine.structured_output.request import Advance, GrammarState, StructuredOutputRequest

if TYPE_CHECKING:
    from engine.sched.output import SchedulerOutput
    from engine.structured_output.manager import StructuredOutputManager


class SchedulerGrammars:
    def __init__(self, manager: StructuredOutputManager | None) -> None:
        """``manager`` compiles grammars; None: constrained requests are refused."""
        self.manager = manager

    def admit(self, request: Request) -> None:
        """Start compiling a new request's constraint (if it has one)."""
        if request.structured_output_request is None:
            return
        if self.manager is None:
            raise ValueError("structured_outputs: this engine has no grammar backend")
        self.manager.grammar_init(request)

    def activate(self, request: Request) -> GrammarState:
        """For a request in WAITING_FOR_FSM: READY once its grammar
        compiled, COMPILING until then, FAILED if it never will."""
        assert self.manager is not None
        return self.manager.activate(request)

    def plan_masks(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """The masks for the step's constrained requests that sample. One
        whose previous token is still in flight (asynchronous scheduling)
        has a grammar that has not seen it: then the whole mask waits
        (``output.pending_grammar``) for ``fill_pending``."""
        if self.manager is None:
            return
        sampling = [
            r
            for rid, n in output.num_scheduled_tokens.items()
            if (r := requests[rid]).structured_output_request is not None
            and r.num_computed_tokens + n >= r.num_tokens + r.num_output_placeholders
        ]
        if any(r.num_output_placeholders for r in sampling):
            output.pending_grammar = [r.request_id for r in sampling]
        else:
            self._set_masks(output, sampling)

    def fill_pending(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """Asynchronous scheduling: ``output``'s masks, once the output of
        the step before it has advanced every grammar. Requests that ended
        meanwhile get no row (their tokens from this step are dropped)."""
        sampling = [
            r
            for rid in output.pending_grammar
            if (r := requests.get(rid)) is not None and not r.is_finished()
        ]
        output.pending_grammar = []
        self._set_masks(output, sampling)

    def _set_masks(self, output: SchedulerOutput, sampling: list[Request]) -> None:
        assert self.manager is not None
        if sampling:
            drafts = output.scheduled_spec_decode_tokens
            output.grammar_bitmask = self.manager.grammar_bitmask(sampling, drafts)

    @staticmethod
    def advance(request: Request, new_token_ids: list[int]) -> Advance | None:
        """Feed a step's tokens to the request's grammar (None: it has none)."""
        so = request.structured_output_request
        if so is None or so.grammar is None:
            return None
        return so.advance(new_token_ids)

    @staticmethod
    def cut_drafts(request: Request, drafts: list[int]) -> list[int]:
        """The drafts the request's grammar accepts, up to its end (drafts
        past that would be rejected anyway); all of them if it has none. A
        grammar that fails here fails its request (``failure``), not the
        engine."""
        so = request.structured_output_request
        if not drafts or so is None or so.grammar is None:
            return list(drafts)
        return _validated(so, drafts)


def _validated(so: StructuredOutputRequest, drafts: list[int]) -> list[int]:
    assert so.grammar is not None
    if so.failure is not None:
        return []
    try:
        return so.grammar.validate_tokens(list(drafts))
    except Exception as exc:  # the library's failure is this request's alone
        so.failure = f"the grammar failed: {library_message(exc)}"
        return []
