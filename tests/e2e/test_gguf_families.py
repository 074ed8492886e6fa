"""Qwen3 and Phi-3 from GGUF files: tiny random models written the way
llama.cpp lays them out (tests/unit/engine/models/tiny_gguf.py: its metadata,
tensor names, Q8_0 blocks for the 2-d weights, SmolLM2's tokenizer fields),
loaded by `--model <file>.gguf`, run on the GGUF's blocks, generate what
transformers generates from the same file (its own GGUF loader dequantizes
them: the directory Tandem's conversion keeps), greedy, 32 tokens on 4
prompts. Qwen3 has QK-norm; Phi-3 keeps its
fused q/k/v and gate/up in one tensor each (attn_qkv, ffn_up)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Phi3Config, PretrainedConfig, Qwen3Config

from engine.llm import LLM
from engine.models.loader import ModelNotFoundError, resolve_model
from engine.sampling_params import SamplingParams
from tests.e2e.teacher_forcing import greedy_mismatches
from tests.unit.engine.models.tiny_gguf import seeded, write_tiny_gguf

VOCAB = 49152  # the tokenizer's (SmolLM2's, copied into each file)
SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
CONFIGS: dict[str, PretrainedConfig] = {
    # Qwen3's GGUF config has no head_dim: transformers takes its default, 128.
    "qwen3": Qwen3Config(**SHAPE, head_dim=128, tie_word_embeddings=True),
    "phi3": Phi3Config(
        **SHAPE,
        pad_token_id=0,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def gguf_file(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch_module: pytest.MonkeyPatch,
) -> Path:
    config = CONFIGS[request.param]
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    hf = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, attn_implementation="eager", dtype=torch.float32
    )
    path = tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.gguf"
    write_tiny_gguf(seeded(hf), path, q8_0=True)
    # The conversion's cache, kept out of the user's.
    monkeypatch_module.setenv("TANDEM_CACHE_DIR", str(path.parent / "cache"))
    return path


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_greedy_output_equals_transformers_from_the_same_file(gguf_file: Path) -> None:
    llm = LLM(str(gguf_file), exact=True, max_model_len=256, kv_cache_memory=2**26)
    assert llm.core.info.weight_format == "q8_0"  # the file's blocks, not expanded
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 17, 33, 60)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outputs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # transformers' float32 model from the directory Tandem's conversion
    # keeps: the config and tensors its own GGUF loader read from the file
    # (loading the GGUF again would parse it again, for the same values).
    hf: Any = AutoModelForCausalLM.from_pretrained(resolve_model(str(gguf_file)))
    assert greedy_mismatches(hf.eval(), prompts, outputs) == []


def test_a_phi3_gguf_with_longrope_factors_is_refused(tmp_path: Path, monkeypatch) -> None:
    """llama.cpp keeps LongRoPE's factors as tensors transformers' config
    reader drops: loading would run plain RoPE, so the file is refused."""
    config = CONFIGS["phi3"]
    config.architectures = ["Phi3ForCausalLM"]
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    factors = np.ones(8, dtype=np.float32)
    path = tmp_path / "longrope.gguf"
    write_tiny_gguf(hf, path, extra={"rope_factors_long.weight": factors})
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelNotFoundError, match="has LongRoPE factors"):
        resolve_model(str(path))
