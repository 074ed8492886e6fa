"""Checks greedy outputs against transformers by teacher forcing: fed a
prompt and the tokens an engine generated after it, transformers' argmax
after the prompt and after each generated token but the last must be the
next generated token. Then transformers' own greedy generate() would produce
the same tokens, and the check costs one forward pass per prompt instead of
one per generated token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def teacher_forced_argmax(
    model: Any, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]
) -> list[list[int]]:
    """transformers' greedy choice at each position of each output (as many
    tokens as the output has), in one forward pass per prompt over the
    prompt and the output but its last token."""
    assert all(outputs), "an empty output: nothing to check"  # logits_to_keep=0 keeps all
    with torch.inference_mode():
        return [
            model(input_ids=torch.tensor([[*p, *o[:-1]]]), logits_to_keep=len(o))
            .logits[0]
            .argmax(-1)
            .tolist()
            for p, o in zip(prompts, outputs, strict=True)
        ]


def greedy_mismatches(
    model: Any, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]
) -> list[str]:
    """One line per output that is not transformers' greedy continuation of
    its prompt (empty when all are)."""
    want = teacher_forced_argmax(model, prompts, outputs)
    return [
        f"prompt {i} ({len(prompts[i])} tokens): engine {list(got)} != transformers {w}"
        for i, (got, w) in enumerate(zip(outputs, want, strict=True))
        if list(got) != w
    ]
