"""The test process's OpenMP setting (below), and session fixtures for
every test directory: the default model, its tokenizer, and LoRA adapters
made with peft with transformers + peft's greedy reference under them, made
once for tests/integration/test_lora.py and tests/e2e/test_lora.py both.
(Imports inside the fixtures: a run of unit tests alone need not load
transformers and peft here.)"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# OpenMP's idle threads (torch's, and the CPU kernels') spin ~300k times
# before they sleep (libgomp's default): right for the one busy process of a
# machine, ruinous for the test run's several (the test process, a
# session's servers, pods starting together) on 2 cores, each spinning on
# the core another needs. Measured on the 2-core machine beside other busy
# processes: lora_reference below 50-200 s against 7.5 s, four NIXL pods
# started together 78-80 s against 28-40 s, a pod's 22 greedy requests
# 60-220 s against 11-14 s. A short spin still catches the next
# kernel of a forward pass, and the outputs are the same (the same threads
# split the same work). Set before torch loads (libgomp reads it then) and
# inherited by every server and child process; a value set outside wins.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from engine.models.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(default_model_path: Path) -> PreTrainedTokenizerBase:
    from engine.models.loader import load_tokenizer

    return load_tokenizer(default_model_path)


@pytest.fixture(scope="session")
def lora_adapters(
    default_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """tests.lora_adapters.ADAPTERS, saved by peft: name -> directory."""
    from tests.lora_adapters import make_adapters

    return make_adapters(default_model_path, tmp_path_factory.mktemp("lora_adapters"))


@pytest.fixture(scope="session")
def lora_prompts(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """tests.lora_adapters.TEXTS, tokenized."""
    from tests.lora_adapters import TEXTS

    return [tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="session")
def lora_reference(
    default_model_path: Path, lora_adapters: dict[str, Path], lora_prompts: list[list[int]]
) -> dict[str | None, list[list[int]]]:
    """transformers + peft's greedy tokens (tests.lora_adapters.MAX_TOKENS of
    them) for each prompt, per adapter (None: the base model)."""
    from tests.lora_adapters import MAX_TOKENS, peft_generate

    return peft_generate(default_model_path, lora_adapters, lora_prompts, MAX_TOKENS)


_TESTS = Path(__file__).resolve().parent
_PARTS = ("unit", "integration", "e2e")


# The modules that keep one worker busy longest (seconds of one worker's
# time on the 2-core machine, 2026-11-29), run before all others: `make
# test` hands modules to its two workers in collection order
# (`--no-loadscope-reorder`), and xdist's own order (most tests first)
# left Gemma's one 47-second test, the P/D modules or the Triton
# interpreter's for the end while the other worker sat idle.
LONGEST_FIRST = (
    "e2e/test_spec_decode.py",  # 71 s
    "e2e/test_quantized_weights.py",  # 68 s
    "e2e/test_gemma3.py",  # 47 s
    "e2e/test_gguf_families.py",  # 34 s
    "integration/test_pd.py",
    "integration/test_nixl.py",
    "integration/test_pd_int8.py",
    "integration/test_pd_preemption.py",
    "integration/test_kv_offload.py",
    "integration/test_service.py",
    "integration/test_lora.py",
    "integration/test_load.py",
    "unit/engine/models/test_triton_layers.py",  # 30 s
    "unit/kernels/test_triton_kernels.py",  # 26 s
    "unit/test_gpu_check.py",  # 22 s
    "unit/service/test_vllm_servicer.py",  # 22 s
    "unit/kernels/test_triton_layer_ops.py",  # 21 s
    "unit/connectors/test_shm_pool.py",  # 21 s
    "unit/kernels/test_sliding_window.py",  # 14 s
    "unit/engine/models/test_loader.py",  # 12 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its directory (unit, integration, e2e), so
    `pytest -m "unit and not slow"` (make check) selects the edit loop's;
    then put LONGEST_FIRST's modules first, in that order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    keys: dict[str, int] = {}
    for item in items:
        parts = item.path.resolve().relative_to(_TESTS).parts
        if parts and parts[0] in _PARTS:
            item.add_marker(parts[0])
        keys[item.nodeid] = rank.get("/".join(parts), len(rank))
    items.sort(key=lambda item: keys[item.nodeid])  # stable: the rest keep their order
