"""Turns the engine core's token outputs into per-request results with text.

The core only knows tokens. This side detokenizes incrementally, checks stop
strings on the text (a match finishes the request: the caller must abort it
in the core with FINISHED_STOPPED, which ``engine.frontend`` does), turns
logprobs into ``TokenLogprob``s with each token's text, puts together the
prompt logprobs that prefill chunks computed step by step, and builds
``RequestOutput``s: one per step for a streamed request (``OutputKind.DELTA``,
the service), one when it finishes for the others (``OutputKind.FINAL``,
``LLM.generate``).

Prefill/decode handover: a ``do_remote_decode`` request that reaches its
length limit hands its output over to a decode pod, so its text does not
end there: its last delta is what a colocated stream would have sent so far
(text that may still become a stop string, and an incomplete UTF-8
character, are held back, not flushed). The decode leg, told how many of
its prompt tokens are this output (``Request.num_output_tokens_in_prompt``),
replays them and streams the rest (engine/detokenizer.py).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.kv_transfer.params import KVTransferParams
from engine.outputs import EngineCoreOutput, LogprobsLists, PromptLogprobs
from engine.request import FinishReason, Request


class OutputKind(enum.Enum):
    """What a request's outputs carry."""

    DELTA = "delta"  # one per step: the tokens and text that step added (streams)
    FINAL = "final"  # one, when the request finishes: all of them (LLM.generate)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The sampled token's logprob and rank, and the top alternatives;
    ``text`` holds the text of the sampled token and of each top one."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float]
    text: dict[int, str] = field(default_factory=dict)

    def ranked(self) -> list[tuple[int, float]]:
        """The top alternatives as (token id, logprob), most likely first."""
        return sorted(self.top.items(), key=lambda kv: kv[1], reverse=True)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one request produced: the one output type, from the engine to
    ``LLM.generate``'s caller or a service stream.

    ``text``, ``token_ids`` and ``logprobs`` (None unless asked for) are what
    this output adds: one step's worth for ``OutputKind.DELTA``, the whole
    output for ``OutputKind.FINAL``. ``num_generated_tokens`` counts every
    token so far. With output tokens in the prompt (a P/D decode leg) the
    text starts where that earlier leg's stream stopped, while the counts
    cover only this leg's tokens. ``finish_reason`` is None until the last.
    ``prompt_logprobs`` (None unless asked for, and on the first output
    only) has one entry per prompt token: None for the first, which has no
    context, then each token's logprob given those before it, its rank and
    the top alternatives (``TokenLogprob``, the prompt token in the place of
    the sampled one). An entry is None too for a token whose logits were
    never computed: only a request aborted mid-prefill has one.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None  # the stop string or stop token id matched
    num_generated_tokens: int
    num_cached_tokens: int
    kv_transfer_params: KVTransferParams | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # The engine refused the request after admitting it (its grammar did
    # not compile): a stream raises this instead of yielding the output.
    error: InvalidRequestError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class ProcessedOutputs:
    """One step, processed."""

    # Every DELTA request the step touched; the FINAL ones that finished.
    outputs: list[RequestOutput] = field(default_factory=list)
    # Requests whose stop string matched: the caller aborts them in the core.
    stopped_by_string: list[str] = field(default_factory=list)
    # Tokens the step gave requests that already had one.
    num_later_tokens: int = 0


TokenText = Callable[[int], str]


def token_text_decoder(tokenizer: PreTrainedTokenizerBase) -> TokenText:
    """One token's text, cached (logprobs name the same tokens again and again)."""

    @lru_cache(maxsize=65536)
    def token_text(token_id: int) -> str:
        return str(tokenizer.decode([token_id]))

    return token_text


@dataclass
class _RequestState:
    request: Request
    prompt: str | None
    kind: OutputKind
    detokenizer: IncrementalDetokenizer
    # A prefill leg (do_remote_decode): at its length limit the output goes
    # on at a decode pod, so held-back text is left for that pod to send.
    hands_over: bool
    # FINAL: every token and logprob so far. DELTA: only the count.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0
    # One entry per prompt token, filled chunk by chunk until the first
    # output takes it (None before and after, or when not asked for).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt logprobs for the request's first output; None after."""
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return taken

    def ends_text(self, core_out: EngineCoreOutput) -> bool:
        """Whether the core ended this request's output here (not a handover)."""
        if not core_out.finished:
            return False
        return not (self.hands_over and core_out.finish_reason == FinishReason.LENGTH)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.token_text = token_text_decoder(tokenizer)
        self._states: dict[str, _RequestState] = {}

    def add_request(
        self, request: Request, prompt: str | None, kind: OutputKind = OutputKind.DELTA
    ) -> None:
        params = request.sampling_params
        detok = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            params,
            num_output_tokens_in_prompt=request.num_output_tokens_in_prompt,
        )
        kv_params = request.kv_transfer_params
        hands_over = bool(kv_params and kv_params.do_remote_decode)
        state = _RequestState(request, prompt, kind, detok, hands_over)
        if params.logprobs is not None:
            state.logprobs = []
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(request.prompt_token_ids)
        self._states[request.request_id] = state

    def has_unfinished(self) -> bool:
        return bool(self._states)

    def abort(self, request_id: str, reason: FinishReason) -> RequestOutput | None:
        """Ends a request outside the core's outputs (aborted, refused, the
        engine died) with ``reason``; returns its final output, or None for
        an id not (or no longer) here."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        if state.kind is OutputKind.FINAL:
            text, token_ids, logprobs = self._whole(state)
        else:
            text, token_ids, logprobs = "", [], [] if state.logprobs is not None else None
        return self._output(state, text, token_ids, logprobs, reason, None, None)

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one step's outputs (see ``ProcessedOutputs``)."""
        processed = ProcessedOutputs()
        for core_out in outputs:
            state = self._states.get(core_out.request_id)
            if state is None:
                continue  # aborted here while the step ran
            if core_out.error is not None:
                refused = self.abort(core_out.request_id, FinishReason.ERROR)
                assert refused is not None
                processed.outputs.append(dataclasses.replace(refused, error=core_out.error))
                continue
            # Tokens after the request's first: a first token ends a TTFT,
            # the later ones each end an inter-token gap.
            num_new = len(core_out.new_token_ids)
            processed.num_later_tokens += max(
                0, min(num_new, state.num_generated_tokens + num_new - 1)
            )
            out, stopped = self._apply(state, core_out)
            if stopped:
                processed.stopped_by_string.append(core_out.request_id)
            if out is not None:
                processed.outputs.append(out)
                if out.finished:
                    del self._states[core_out.request_id]
        return processed

    def _apply(
        self, state: _RequestState, core_out: EngineCoreOutput
    ) -> tuple[RequestOutput | None, bool]:
        """One request's step: its output (None for a FINAL one still
        running), and whether a stop string ended it here (not the core)."""
        new_ids = core_out.new_token_ids
        if core_out.new_prompt_logprobs is not None:
            self._add_prompt_logprobs(state, core_out.new_prompt_logprobs)
            if not new_ids and not core_out.finished:
                return None, False  # a prefill chunk: nothing to send yet
        detok = state.detokenizer
        # Several tokens (accepted drafts) are cut after a stop string's end.
        stop_string, new_ids = detok.update_until_stop(new_ids)
        state.num_generated_tokens += len(new_ids)
        state.num_cached_tokens = max(core_out.num_cached_tokens, 0)
        new_logprobs = self._logprobs(state, core_out)[: len(new_ids)]
        if stop_string is None and state.ends_text(core_out):
            # Flushing held-back text can still complete a stop string.
            stop_string = detok.finish()
        reason, stop_reason = core_out.finish_reason, core_out.stop_reason
        if stop_string is not None:
            reason, stop_reason = FinishReason.STOP, stop_string
        stopped = stop_string is not None and not core_out.finished
        if state.kind is OutputKind.FINAL:
            state.token_ids.extend(new_ids)
            if state.logprobs is not None:
                state.logprobs.extend(new_logprobs)
            if reason is None:
                return None, stopped
            text, token_ids, logprobs = self._whole(state)
        else:
            text, token_ids = detok.get_next_delta(), list(new_ids)
            logprobs = new_logprobs if state.logprobs is not None else None
        params = core_out.kv_transfer_params if reason is not None else None
        return self._output(state, text, token_ids, logprobs, reason, stop_reason, params), stopped

    def _logprobs(self, state: _RequestState, core_out: EngineCoreOutput) -> list[TokenLogprob]:
        lists = core_out.new_logprobs
        if state.logprobs is None or lists is None:
            return []
        want = state.request.sampling_params.logprobs or 0
        return _logprob_entries(lists, want, self.token_text)

    def _add_prompt_logprobs(self, state: _RequestState, chunk: PromptLogprobs) -> None:
        """Puts a chunk's rows in their places (a prompt computed again
        after preemption gives the same places again)."""
        entries = state.prompt_logprobs
        if entries is None:
            return  # not asked for, or already sent
        want = state.request.sampling_params.prompt_logprobs or 0
        new = _logprob_entries(chunk.logprobs, want, self.token_text)
        entries[chunk.first_token : chunk.first_token + len(new)] = new

    @staticmethod
    def _whole(state: _RequestState) -> tuple[str, list[int], list[TokenLogprob] | None]:
        """A FINAL request's text, tokens and logprobs so far."""
        return state.detokenizer.output_text, state.token_ids, state.logprobs

    @staticmethod
    def _output(
        state: _RequestState,
        text: str,
        token_ids: list[int],
        logprobs: list[TokenLogprob] | None,
        reason: FinishReason | None,
        stop_reason: int | str | None,
        kv_transfer_params: KVTransferParams | None,
    ) -> RequestOutput:
        request = state.request
        return RequestOutput(
            request_id=request.request_id,
            prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=reason,
            stop_reason=stop_reason,
            num_generated_tokens=state.num_generated_tokens,
            num_cached_tokens=state.num_cached_tokens,
            kv_transfer_params=kv_transfer_params,
            prompt_logprobs=state.take_prompt_logprobs(),
        )


def _logprob_entries(
    lists: LogprobsLists, num_top: int, token_text: TokenText
) -> list[TokenLogprob]:
    entries = []
    for ids, lps, rank in zip(
        lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks, strict=True
    ):
        top = dict(zip(ids[1 : 1 + num_top], lps[1 : 1 + num_top], strict=True))
        text = {t: token_text(t) for t in (ids[0], *top)}
        entries.append(TokenLogprob(ids[0], lps[0], rank, top, text))
    return entries
