"""The scheduler benchmark's workload, shared by Tandem's run and the vLLM
baseline (so this module imports neither)."""

from __future__ import annotations

import random

BLOCK_SIZE = 16
PROMPT_BASE = 128


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """N distinct prompts of 128..143 tokens (no shared prefixes), so block
    boundaries fall on different steps for different requests."""
    rng = random.Random(seed)
    return [
        [rng.randrange(1, 32000) for _ in range(PROMPT_BASE + i % BLOCK_SIZE)] for i in range(n)
    ]


def limits(n: int, steps: int) -> tuple[int, int, int]:
    """(max_model_len, num_blocks, max_num_batched_tokens) for N requests:
    room for the decode steps taken while later prompts prefill, too."""
    budget = max(8192, n)
    warm_steps = 2 * n * (PROMPT_BASE + BLOCK_SIZE) // budget + 8
    max_len = PROMPT_BASE + BLOCK_SIZE + warm_steps + steps + 16
    num_blocks = n * -(-max_len // BLOCK_SIZE) + 1
    return max_len, num_blocks, budget
