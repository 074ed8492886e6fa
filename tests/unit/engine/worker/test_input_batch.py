"""InputBatch.group_by_lora: rows of one adapter contiguous, row data moved
with them."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from engine.worker.input_batch import CachedRequestState, InputBatch


def _state(rid: str, lora: int, tokens: list[int]) -> CachedRequestState:
    return CachedRequestState(
        req_id=rid,
        token_ids=tokens,
        num_prompt_tokens=len(tokens),
        sampling_params=SamplingParams(),
        generator=None,
        block_ids=([tokens[0], tokens[0] + 1],),
        num_computed_tokens=len(tokens) - 1,
        lora_int_id=lora,
    )


def test_group_by_lora_moves_whole_rows():
    batch = InputBatch(max_num_reqs=4, max_model_len=16, max_blocks_per_req=4)
    rows = [("a", 2, [10, 11, 12]), ("b", 0, [20, 21]), ("c", 2, [30]), ("d", 1, [40, 41, 42, 43])]
    for rid, lora, tokens in rows:
        batch.add(_state(rid, lora, tokens))
    batch.group_by_lora()
    assert batch.req_ids == ["b", "d", "a", "c"]
    assert batch.req_id_to_index == {"b": 0, "d": 1, "a": 2, "c": 3}
    for row, (rid, _, tokens) in enumerate(sorted(rows, key=lambda r: r[1])):
        assert batch.states[row].req_id == rid
        assert batch.token_ids[row, : len(tokens)].tolist() == tokens
        assert batch.num_tokens[row] == len(tokens)
        assert batch.num_computed_tokens[row] == len(tokens) - 1
        assert batch.block_table[row, :2].tolist() == [tokens[0], tokens[0] + 1]
