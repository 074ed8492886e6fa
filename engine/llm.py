"""LLM: the offline batch API.

    llm = LLM()                      # the default model, on CPU or CUDA
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(outs[0].text, outs[0].finish_reason, outs[0].num_cached_tokens)
    # Each prompt token's logprob and top-5 (None first: it has no context).
    out = llm.generate("Hello there", SamplingParams(max_tokens=1, prompt_logprobs=5))[0]
    print([lp and (lp.token_id, lp.logprob, lp.rank, lp.top) for lp in out.prompt_logprobs])

All prompts are queued at once and the engine steps until every one is done,
so the scheduler batches them (continuous batching, chunked prefill, prefix
caching) exactly as it would for a server. Input checks, text, stop strings
and ``totals`` come from the same ``FrontEnd`` (engine/frontend.py) the
service's AsyncEngine uses; here it is driven synchronously, step by step.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import cast

from tqdm.auto import tqdm  # type: ignore[import-untyped]
from transformers import PreTrainedTokenizerBase

from engine.chat_template import ChatMessage
from engine.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.core import EngineCore
from engine.frontend import FrontEnd
from engine.input_processor import InputProcessor, ProcessedPrompt, PromptInput
from engine.lora.request import LoRARequest
from engine.models.loader import load_tokenizer, resolve_model
from engine.output_processor import OutputKind, RequestOutput
from engine.request import FinishReason
from engine.request_options import RequestOptions
from engine.sampling_params import SamplingParams
from engine.status import EngineStatus

Prompt = PromptInput


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        **overrides: object,
    ) -> None:
        """``config`` sets every knob; ``overrides`` are field names of
        ModelConfig, SchedulerConfig or CacheConfig, e.g. ``dtype="bfloat16"``,
        ``quantization="int8"``, ``int8_activations=True``,
        ``max_num_batched_tokens=64``, ``kv_cache_memory=2**27``,
        ``exact=True`` (the bit-exact path where int8 activations and a
        bfloat16 KV cache are the default: GGUF blocks on CPU). The weights'
        format in memory is then ``llm.core.info.weight_format``, the
        numerics that run ``llm.core.info.numerics`` (engine/numerics.py)."""
        config = _apply_overrides(config or EngineConfig(), model, overrides)
        # First: a template that does not render fails before the weights
        # load (a GGUF not converted yet converts first, once).
        tokenizer = load_tokenizer(resolve_model(config.model.model), config.model.chat_template)
        self._attach(EngineCore(config), tokenizer)

    @classmethod
    def around(cls, core: EngineCore, tokenizer: PreTrainedTokenizerBase) -> LLM:
        """An LLM over a core built elsewhere (tests, tools)."""
        llm = cls.__new__(cls)
        llm._attach(core, tokenizer)
        return llm

    def _attach(self, core: EngineCore, tokenizer: PreTrainedTokenizerBase) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.front = FrontEnd(core, tokenizer, core.info)
        self._ids = itertools.count()

    @property
    def inputs(self) -> InputProcessor:
        return self.front.inputs

    @property
    def totals(self) -> EngineStatus:
        """Counts summed over every step since the LLM was built (live)."""
        return self.front.status

    def chat_prompt(self, messages: list[ChatMessage]) -> str:
        """The chat template's text, for display. ``chat`` tokenizes chat
        so content stays text; ``generate`` on this text would read a
        special token spelled in content as a control token."""
        return self.inputs.render_chat(messages)

    def chat(
        self,
        conversations: list[ChatMessage] | Sequence[list[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates a reply to each conversation (or to one: a list of
        messages), in order, through the model's chat template; special
        tokens in content are text (engine/chat_template.py)."""
        prompts = [self.inputs.process_chat(c) for c in _as_conversations(conversations)]
        return self._generate(prompts, sampling_params, None, None, use_tqdm)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        lora: str | Sequence[str | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt (text, token ids, or vLLM's dict forms
        ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``); results are in
        prompt order. ``lora``: a loaded adapter's name for every prompt, or
        one per prompt (None: the base model). Invalid input raises before
        anything is queued."""
        processed = [self.inputs.process_prompt(p) for p in _as_prompt_list(prompts)]
        return self._generate(processed, sampling_params, priority, lora, use_tqdm)

    def _generate(
        self,
        prompts: list[ProcessedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
        lora: str | Sequence[str | None] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        count = len(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), count)
        priorities = list(priority) if priority is not None else [0] * count
        loras = [lora] * count if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != count:
            raise ValueError(f"lora: got {len(loras)} names for {count} prompts")
        requests = [
            self.inputs.make_request(
                f"offline-{next(self._ids)}", p, sp, RequestOptions(priority=prio, lora_name=name)
            )
            for p, sp, prio, name in zip(prompts, params, priorities, loras, strict=True)
        ]
        for req, p in zip(requests, prompts, strict=True):
            self.front.add_request(req, p.text, OutputKind.FINAL)
            self.core.add_request(req)
        finished = self._run({r.request_id for r in requests}, use_tqdm)
        return [finished[r.request_id] for r in requests]

    def load_lora(self, name: str, path: str) -> LoRARequest:
        """Loads the PEFT adapter at ``path`` under ``name`` (needs
        ``LLM(lora=LoRAConfig(...))``); errors name the file and key."""
        self.front.loras.check_new_name(name)
        request, adapter = self.front.loras.read(name, path)
        self.front.loras.add(request)
        self.core.add_lora(request, adapter)
        return request

    def unload_lora(self, name: str) -> None:
        self.core.remove_lora(self.front.loras.remove(name).lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.front.loras.loaded()

    def _run(self, request_ids: set[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        """Steps the core until each of ``request_ids`` has its output
        (requests an interrupted earlier call left behind are not waited for)."""
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm)
        with bar:
            while len(finished) < len(request_ids):
                start = time.perf_counter()
                step = self.core.step()
                seconds = time.perf_counter() - start
                for out in self.front.process_step(step, seconds).outputs:
                    if out.error is not None:
                        self._abort_rest(request_ids, finished)
                        raise out.error
                    if out.request_id in request_ids:
                        finished[out.request_id] = out
                        bar.update(1)
        return finished

    def _abort_rest(self, request_ids: set[str], finished: dict[str, RequestOutput]) -> None:
        """A request the engine refused (its grammar did not compile) fails
        the call, as invalid input does before anything is queued: the
        call's other requests are ended, not left to a later call."""
        rest = [rid for rid in request_ids if rid not in finished]
        for rid in rest:
            self.front.abort(rid, FinishReason.ABORT)
        self.core.abort_requests(rest)


def _as_conversations(
    conversations: list[ChatMessage] | Sequence[list[ChatMessage]],
) -> list[list[ChatMessage]]:
    if conversations and isinstance(conversations[0], dict):
        return [cast(list[ChatMessage], conversations)]
    return [list(c) for c in cast(Sequence[list[ChatMessage]], conversations)]


def _apply_overrides(
    config: EngineConfig, model: str | None, overrides: dict[str, object]
) -> EngineConfig:
    parts: dict[str, dict[str, object]] = {"model": {}, "scheduler": {}, "cache": {}}
    if model is not None:
        parts["model"]["model"] = model
    owners = {
        "model": ModelConfig.__dataclass_fields__,
        "scheduler": SchedulerConfig.__dataclass_fields__,
        "cache": CacheConfig.__dataclass_fields__,
    }
    # Options that take a whole config object (None turns the feature off).
    objects: dict[str, type] = {
        "kv_transfer": KVTransferConfig,
        "speculative": SpeculativeConfig,
        "lora": LoRAConfig,
    }
    whole = {name: getattr(config, name) for name in objects}
    for name, value in overrides.items():
        if name in objects:
            kind = objects[name]
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"LLM({name}=...) wants a {kind.__name__}, got {value!r}")
            whole[name] = value
            continue
        owner = next((part for part, fields in owners.items() if name in fields), None)
        if owner is None:
            raise TypeError(f"LLM() got an unknown option {name!r}")
        parts[owner][name] = value
    return replace(
        config,
        **whole,
        model=replace(config.model, **parts["model"]),  # type: ignore[arg-type]
        scheduler=replace(config.scheduler, **parts["scheduler"]),  # type: ignore[arg-type]
        cache=replace(config.cache, **parts["cache"]),  # type: ignore[arg-type]
    )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | dict):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # type: ignore[list-item]  # one prompt of token ids
    return items  # type: ignore[return-value]


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams], count: int
) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(
            f"sampling_params: got {len(params)} for {count} prompts; expected one or one each"
        )
    return params


def _demo() -> None:
    """``python -m engine.llm``: a few chat prompts on the default model."""
    # Show the one-time steps (model conversion, kernel build) as they happen.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    llm = LLM()
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Name three fruits that are red.",
    ]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    start = time.perf_counter()
    outs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=96))
    elapsed = time.perf_counter() - start
    for q, out in zip(questions, outs, strict=True):
        print(f"\n>>> {q}\n{out.text.strip()}\n[{len(out.token_ids)} tokens, {out.finish_reason}]")
    total = sum(len(o.token_ids) for o in outs)
    print(f"\n{total} tokens in {elapsed:.1f} s ({total / elapsed:.1f} tok/s)")


if __name__ == "__main__":
    _demo()
    # torch 2.13 loads triton lazily for some CPU ops, and triton's nanobind
    # bindings print pages of "leaked" warnings at interpreter teardown.
    # Nothing is left to clean up here, so skip the teardown.
    sys.stdout.flush()
    os._exit(0)
