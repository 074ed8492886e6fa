"""The xgrammar backend (PyPI ``xgrammar``): what SGLang and TensorRT-LLM
default to, and vLLM's default for the kinds here.

The tokenizer info is built once per backend from the HF tokenizer, with
the *model's* vocabulary size: rows past the tokenizer's vocabulary (a
padded embedding) are never allowed.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from engine.structured_output.backend import (
    CompiledGrammar,
    Grammar,
    GrammarCompileError,
    library_message,
)
from engine.structured_output.params import ConstraintKind, StructuredOutputParams

if TYPE_CHECKING:
    from engine.structured_output.backend import Bitmask


class XGrammarGrammar:
    """One request's ``xgr.GrammarMatcher``."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        accept = self._matcher.accept_token
        return all(accept(t) for t in token_ids)

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        accepted = 0
        for token_id in token_ids:
            if not self._matcher.accept_token(token_id):
                break
            accepted += 1
            if self._matcher.is_terminated():
                break  # nothing follows the grammar's end
        if accepted:
            self._matcher.rollback(accepted)
        return token_ids[:accepted]

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: Bitmask, row: int) -> None:
        self._matcher.fill_next_token_bitmask(torch.from_numpy(bitmask), row)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XGrammarBackend:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        """``vocab_size``: the model's (its logits' width)."""
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # One thread: the manager's pool is the parallelism, and the engine's
        # torch threads own the cores.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        try:
            return self._compile(params)
        except (RuntimeError, ValueError) as exc:  # xgrammar raises these for bad input
            raise GrammarCompileError(library_message(exc)) from exc

    def _compile(self, params: StructuredOutputParams) -> xgr.CompiledGrammar:
        compiler = self._compiler
        match params.kind:
            case ConstraintKind.JSON:
                return compiler.compile_json_schema(params.spec, any_whitespace=False)
            case ConstraintKind.JSON_OBJECT:
                # Not compile_builtin_json_grammar(): that takes any JSON
                # value (an array, a number), and OpenAI's json_object
                # promises an object.
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            case ConstraintKind.REGEX:
                return compiler.compile_regex(params.spec)
            case ConstraintKind.GRAMMAR:
                return compiler.compile_grammar(params.spec)
            case ConstraintKind.CHOICE:
                return compiler.compile_grammar(choice_grammar(json.loads(params.spec)))

    def matcher(self, compiled: CompiledGrammar) -> Grammar:
        return XGrammarGrammar(xgr.GrammarMatcher(cast(xgr.CompiledGrammar, compiled)))

    def allocate_bitmask(self, rows: int) -> Bitmask:
        words = (self.vocab_size + 31) // 32
        return np.full((rows, words), -1, dtype=np.int32)

    def fill_bitmasks(self, grammars: list[Grammar], bitmask: Bitmask) -> None:
        matchers = [cast(XGrammarGrammar, g)._matcher for g in grammars]
        self._batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(bitmask))


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``. JSON string
    literals are EBNF string literals (the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
