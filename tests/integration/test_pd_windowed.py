"""A P/D hand-over of a model with sliding-window layers over the
shared-memory connector: a tiny random Gemma 3 (two of its three layers
attend to their last 6 tokens, with their own RoPE base) answers through
`tandem router` + prefill and decode pods exactly as one colocated pod does.

Every layer keeps every block of a request (the KV cache is not windowed:
docs/models.md), so the hand-over moves the same blocks as for any model;
what this pins is that the decode pod's windowed layers read the handed-over
blocks at the right positions, past the window."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from service.gen.tandem.v1 import generation_pb2 as pb
from tests.integration.servers import ServerProcess, launched
from tests.integration.test_pd import (
    PROMPTS,
    SMALL,
    _check_parity,
    _generate,
    _generate_all,
    _kv,
    _pd_stack,
    _status,
)
from tests.unit.engine.models.families import (
    TINY_SHAPE,
    architecture_name,
    family_configs,
    randomize_weights,
)

WINDOW = 6


@pytest.fixture(scope="module")
def windowed_model(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerBase
) -> Path:
    """The tiny Gemma 3 of the family tests, over the default tokenizer's vocabulary."""
    shape = {**TINY_SHAPE, "vocab_size": len(tokenizer), "max_position_embeddings": 512}
    config = family_configs(shape)["gemma3-sliding-window"]
    config.architectures = [architecture_name(config)]
    assert config.sliding_window == WINDOW
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    randomize_weights(hf)
    path = tmp_path_factory.mktemp("gemma3-windowed")
    hf.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def colocated(windowed_model: Path) -> Iterator[ServerProcess]:
    pod = ServerProcess(["--model", str(windowed_model), *SMALL])
    with launched(pod):
        yield pod


@pytest.fixture(scope="module")
def windowed_pd(windowed_model: Path, colocated: ServerProcess) -> Iterator[tuple[str, str, str]]:
    extra = {"pool_name": f"pdw-{uuid.uuid4().hex[:8]}", "capacity_bytes": 64 << 20}
    yield from _pd_stack(
        _kv("shm", "kv_producer", extra),
        _kv("shm", "kv_consumer", extra),
        ("--model", str(windowed_model)),
    )


def test_windowed_model_over_shared_memory_matches_colocated(
    windowed_pd: tuple[str, str, str], colocated: ServerProcess
) -> None:
    router, _, decode = windowed_pd
    colocated.wait_started()  # launched beside the stack: not waited for until now
    want: list[pb.GenerateResponse] = asyncio.run(_generate_all(colocated.target, PROMPTS))
    first = asyncio.run(_generate(router, PROMPTS[0]))
    assert first.usage.prompt_tokens > 4 * WINDOW
    # The decode pod's counters say the prompt came through the connector.
    hits = asyncio.run(_status(decode)).kv_connector_hits
    assert hits >= 16 * (first.usage.prompt_tokens // 16 - 1)
    got = asyncio.run(_generate_all(router, PROMPTS))
    _check_parity([first], want[:1])
    _check_parity(got, want)
