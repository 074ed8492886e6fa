"""Turns the engine core's token outputs into per-request results with text.

The core only knows tokens. This side detokenizes incrementally, checks stop
strings on the text (a match finishes the request: the caller must abort it
in the core with FINISHED_STOPPED), accumulates logprobs, and builds
``RequestOutput`` objects, complete or as streaming deltas.

Prefill/decode handover: a ``do_remote_decode`` request that reaches its
length limit hands its output over to a decode pod, so its text does not
end there: its last delta is what a colocated stream would have sent so far
(text that may still become a stop string, and an incomplete UTF-8
character, are held back, not flushed). The decode leg, told how many of
its prompt tokens are this output (``Request.num_output_tokens_in_prompt``),
replays them and streams the rest (engine/detokenizer.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from connectors.kv_transfer_params import KVTransferParams
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import EngineCoreOutput, LogprobsLists
from engine.request import FinishReason, Request


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The sampled token's logprob and rank, and the top alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float]


@dataclass
class RequestOutput:
    """One request's result so far. ``text``/``token_ids`` are cumulative;
    ``delta_text``/``new_token_ids`` are what this update added. With
    output tokens in the prompt, ``text`` starts with theirs (the whole
    output's text) while ``token_ids`` holds only the generated ones."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or token id matched
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None


@dataclass
class _RequestState:
    output: RequestOutput
    detokenizer: IncrementalDetokenizer
    want_logprobs: int | None
    # A prefill leg (do_remote_decode): at its length limit the output goes
    # on at a decode pod, so held-back text is left for that pod to send.
    hands_over: bool = False

    def ends_text(self, core_out: EngineCoreOutput) -> bool:
        """Whether the core ended this request's output here (not a handover)."""
        if not core_out.finished:
            return False
        return not (self.hands_over and core_out.finish_reason == FinishReason.LENGTH)


def _logprob_entries(lists: LogprobsLists, num_top: int) -> list[TokenLogprob]:
    entries = []
    for ids, lps, rank in zip(
        lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks, strict=True
    ):
        top = dict(zip(ids[1 : 1 + num_top], lps[1 : 1 + num_top], strict=True))
        entries.append(TokenLogprob(ids[0], lps[0], rank, top))
    return entries


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request: Request, prompt: str | None) -> None:
        params = request.sampling_params
        output = RequestOutput(request.request_id, prompt, request.prompt_token_ids)
        if params.logprobs is not None:
            output.logprobs = []
        detok = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            params,
            num_output_tokens_in_prompt=request.num_output_tokens_in_prompt,
        )
        kv_params = request.kv_transfer_params
        hands_over = bool(kv_params and kv_params.do_remote_decode)
        state = _RequestState(output, detok, params.logprobs, hands_over)
        self._states[request.request_id] = state

    def has_unfinished(self) -> bool:
        return bool(self._states)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request the caller aborted; returns its final output."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        out = state.output
        out.finished, out.finish_reason = True, "abort"
        out.delta_text, out.new_token_ids = "", []
        return out

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs. Returns the updated request outputs and
        the ids whose stop string matched (to abort in the core)."""
        results: list[RequestOutput] = []
        stopped_by_string: list[str] = []
        for core_out in outputs:
            state = self._states.get(core_out.request_id)
            if state is None:
                continue  # aborted here while the step ran
            if self._apply(state, core_out):
                stopped_by_string.append(core_out.request_id)
            results.append(state.output)
            if state.output.finished:
                del self._states[core_out.request_id]
        return results, stopped_by_string

    def _apply(self, state: _RequestState, core_out: EngineCoreOutput) -> bool:
        out = state.output
        new_ids = core_out.new_token_ids
        out.new_token_ids = new_ids
        out.token_ids.extend(new_ids)
        out.num_cached_tokens = max(core_out.num_cached_tokens, 0)
        if out.logprobs is not None and core_out.new_logprobs is not None:
            out.logprobs.extend(_logprob_entries(core_out.new_logprobs, state.want_logprobs or 0))
        detok = state.detokenizer
        stop_string = detok.update(new_ids)
        if stop_string is None and state.ends_text(core_out):
            # Flushing held-back text can still complete a stop string.
            stop_string = detok.finish()
        finished = core_out.finished or stop_string is not None
        if stop_string is not None:
            out.finish_reason, out.stop_reason = "stop", stop_string
        elif core_out.finish_reason is not None:
            out.finish_reason, out.stop_reason = str(core_out.finish_reason), core_out.stop_reason
        if finished:
            out.finished = True
            out.kv_transfer_params = core_out.kv_transfer_params
        out.delta_text = detok.get_next_delta()
        out.text = detok.output_text
        return stop_string is not None and not core_out.finished
