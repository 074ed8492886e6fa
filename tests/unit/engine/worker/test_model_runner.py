"""The model runner's bookkeeping: persistent batch deltas and step inputs.

The model here is a recording double (this is a unit test of the runner's
input building); real models run through the runner in tests/e2e.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.sampling_params import SamplingParams
from engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine.worker.model_runner import ModelRunner
from kernels.metadata import AttentionMetadata

BLOCK = 4
VOCAB = 50


class RecordingModel:
    """Logits favour token (last input id + 1), so sampling is predictable."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int], AttentionMetadata]] = []

    def __call__(self, input_ids, positions, kv_caches, meta, layer_metas=None):
        self.calls.append((input_ids.tolist(), positions.tolist(), meta))
        return input_ids.float()[:, None]

    def compute_logits(self, hidden):
        logits = torch.zeros(hidden.shape[0], VOCAB)
        logits[torch.arange(hidden.shape[0]), (hidden[:, 0].long() + 1) % VOCAB] = 1.0
        return logits


def make_runner() -> tuple[ModelRunner, RecordingModel]:
    model = RecordingModel()
    runner = ModelRunner(
        model, [], block_size=BLOCK, max_num_reqs=4, max_model_len=32, device=torch.device("cpu")
    )
    return runner, model


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8)


def step(new=(), cached=None, scheduled=None, finished=()) -> SchedulerOutput:
    scheduled = scheduled or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or CachedRequestData(),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        num_common_prefix_blocks=0,
        finished_req_ids=set(finished),
    )


def cached(req_ids, computed, new_blocks, resumed=(), all_tokens=None) -> CachedRequestData:
    return CachedRequestData(
        req_ids=list(req_ids),
        resumed_req_ids=set(resumed),
        all_token_ids=all_tokens or {},
        # Tests name one KV cache group's blocks.
        new_block_ids=[(ids,) if ids is not None else None for ids in new_blocks],
        num_computed_tokens=list(computed),
        num_output_tokens=[0] * len(req_ids),
    )


def test_mixed_batch_inputs_positions_slots_and_sampling_rows():
    runner, model = make_runner()
    a = NewRequestData("a", [10, 11, 12, 13, 14, 15], greedy(), ([7, 3],), 0)
    b = NewRequestData("b", [20, 21, 22], greedy(), ([5],), 0)
    # a computes a 4-token chunk (no sample), b its whole prompt (samples).
    out = runner.execute_model(step([a, b], scheduled={"a": 4, "b": 3}))
    ids, positions, meta = model.calls[-1]
    assert ids == [10, 11, 12, 13, 20, 21, 22]
    assert positions == [0, 1, 2, 3, 0, 1, 2]
    assert meta.slot_mapping.tolist() == [28, 29, 30, 31, 20, 21, 22]
    assert meta.query_start_loc.tolist() == [0, 4, 7]
    assert meta.seq_lens.tolist() == [4, 3]
    assert meta.block_table.tolist() == [[7], [5]]
    assert meta.max_query_len == 4 and not meta.decode_only
    assert out.req_ids == ["a", "b"]
    assert out.sampled_token_ids == [[], [23]]

    # a finishes its prompt; b decodes the token sampled last step.
    out = runner.execute_model(
        step(cached=cached(["a", "b"], [4, 3], [None, None]), scheduled={"a": 2, "b": 1})
    )
    ids, positions, meta = model.calls[-1]
    assert ids == [14, 15, 23]
    assert positions == [4, 5, 3]
    assert meta.slot_mapping.tolist() == [12, 13, 23]
    assert meta.seq_lens.tolist() == [6, 4]
    assert out.sampled_token_ids == [[16], [24]]


def test_new_blocks_finish_skip_and_resume():
    runner, model = make_runner()
    runner.execute_model(
        step([NewRequestData("a", [1, 2, 3, 4], greedy(), ([2],), 0)], scheduled={"a": 4})
    )
    runner.execute_model(
        step([NewRequestData("b", [9, 9], greedy(), ([6],), 0)], scheduled={"b": 2})
    )
    # a was skipped last step: it is re-sent with all its tokens and a new block.
    runner.execute_model(
        step(
            cached=cached(["a"], [4], [[8]], all_tokens={"a": [1, 2, 3, 4, 5]}),
            scheduled={"a": 1},
        )
    )
    ids, positions, meta = model.calls[-1]
    assert (ids, positions, meta.slot_mapping.tolist()) == ([5], [4], [32])
    assert runner.batch.req_ids == ["a"]  # b was not scheduled: its row left
    # b resumes after preemption with new blocks, recomputing from scratch.
    out = runner.execute_model(
        step(
            cached=cached(["b"], [0], [[1]], resumed=["b"], all_tokens={"b": [9, 9, 10]}),
            scheduled={"b": 3},
            finished=["a"],
        )
    )
    ids, positions, meta = model.calls[-1]
    assert ids == [9, 9, 10] and meta.slot_mapping.tolist() == [4, 5, 6]
    assert out.req_ids == ["b"] and out.sampled_token_ids == [[11]]
    assert "a" not in runner.requests


def test_removing_a_row_moves_the_last_into_the_hole():
    runner, _ = make_runner()
    new = [NewRequestData(r, [i + 1] * 3, greedy(), ([i + 1],), 0) for i, r in enumerate("abc")]
    runner.execute_model(step(new, scheduled={"a": 3, "b": 3, "c": 3}))
    runner.execute_model(
        step(
            finished=["a"],
            cached=cached(["b", "c"], [3, 3], [None, None]),
            scheduled={"b": 1, "c": 1},
        )
    )
    batch = runner.batch
    assert batch.req_ids == ["c", "b"]
    assert batch.req_id_to_index == {"c": 0, "b": 1}
    np.testing.assert_array_equal(batch.token_ids[0, :5], [3, 3, 3, 4, 5])
    np.testing.assert_array_equal(batch.block_table[0, :1], [3])


class FavouriteModel:
    """Logits favour token 7 (1.0), then 8 (0.5); every other token is 0."""

    def __call__(self, input_ids, positions, kv_caches, meta, layer_metas=None):
        return torch.zeros(input_ids.shape[0], 1)

    def compute_logits(self, hidden):
        logits = torch.zeros(hidden.shape[0], VOCAB)
        logits[:, 7] = 1.0
        logits[:, 8] = 0.5
        return logits


def test_penalties_count_the_runners_tokens_and_an_earlier_legs_output():
    runner = ModelRunner(
        FavouriteModel(), [], block_size=BLOCK, max_num_reqs=4, max_model_len=32,
        device=torch.device("cpu"),
    )  # fmt: skip
    presence = SamplingParams(temperature=0.0, max_tokens=8, presence_penalty=1.0)
    # b's 7 ends its prompt but is output of an earlier leg (P/D): penalized.
    a = NewRequestData("a", [7, 7], presence, ([1],), 0)
    b = NewRequestData("b", [3, 7], presence, ([2],), 0, num_output_tokens_in_prompt=1)
    c = NewRequestData("c", [1, 2], greedy(), ([3],), 0)
    out = runner.execute_model(step([a, c, b], scheduled={"a": 2, "b": 2, "c": 2}))
    assert out.sampled_token_ids == [[7], [7], [8]]  # a's prompt 7s are not output
    # a leaves: b moves into its row, and its output start moves with it.
    out = runner.execute_model(
        step(finished=["a"], cached=cached(["b", "c"], [2, 2], [None, None]),
             scheduled={"b": 1, "c": 1})
    )  # fmt: skip
    assert runner.batch.req_ids == ["b", "c"]
    # b: 7 -> 0 and 8 -> -0.5, so the first 0-logit token (0) wins.
    assert out.sampled_token_ids == [[0], [7]]


class ScriptedProposer:
    """Proposes, after each step, the drafts the test set for a request."""

    def __init__(self) -> None:
        self.next: dict[str, list[int]] = {}
        self.seen: list[list[int]] = []  # each call's history of request "a"

    def propose(self, inputs) -> list[list[int]]:
        batch = inputs.batch
        for r in inputs.rows.tolist():
            if batch.req_ids[r] == "a":
                self.seen.append(batch.token_ids[r, : batch.num_tokens[r]].tolist())
        return [list(self.next.get(batch.req_ids[r], [])) for r in inputs.rows.tolist()]

    def reset(self, req_id: str, num_valid: int) -> None:
        pass

    def remove(self, req_id: str) -> None:
        pass


def _async_step(computed: int, scheduled: int, k: int) -> SchedulerOutput:
    """The asynchronous scheduler's view: request "a" with one token in
    flight and ``k`` placeholder drafts."""
    data = cached(["a"], [computed], [None])
    data.in_flight_req_ids.add("a")
    so = step(cached=data, scheduled={"a": scheduled})
    so.scheduled_spec_decode_tokens = {"a": [-1] * k}
    return so


def test_placeholder_drafts_run_only_the_drafts_proposed():
    """Asynchronous scheduling plans k drafts before they exist: the runner
    verifies what its proposer found (none: a plain one-token decode), and
    takes what the scheduler over-counted (rejected, or never run) off the
    next step."""
    runner, model = make_runner()
    proposer = ScriptedProposer()
    runner.attach_proposer(proposer, num_spec_tokens=3)
    prompt = NewRequestData("a", [10, 11, 12], greedy(), ([7, 3],), 0)
    proposer.next["a"] = [14, 99]
    assert runner.execute_model(step([prompt], scheduled={"a": 3})).sampled_token_ids == [[13]]
    # Planned: the in-flight token 13 and 3 placeholders. Run: 13, 14, 99;
    # 14 is accepted, 99 is not (the model says 15).
    proposer.next["a"] = []
    out = runner.execute_model(_async_step(computed=3, scheduled=4, k=3))
    ids, positions, _ = model.calls[-1]
    assert (ids, positions) == ([13, 14, 99], [3, 4, 5])
    assert out.sampled_token_ids == [[14, 15]]
    assert out.num_verified_drafts == {"a": 2}
    # The scheduler counted 3 + 4 computed; 2 of the 4 did not hold.
    out = runner.execute_model(_async_step(computed=7, scheduled=4, k=3))
    ids, positions, _ = model.calls[-1]
    assert (ids, positions) == ([15], [5])  # nothing proposed: one row
    assert out.sampled_token_ids == [[16]]
    assert out.num_verified_drafts == {"a": 0}
    # Scheduled before the last output arrived: 7 + 4, less the two
    # rejections of the step before it, which the scheduler knows by then.
    out = runner.execute_model(_async_step(computed=9, scheduled=4, k=3))
    ids, positions, _ = model.calls[-1]
    assert (ids, positions) == ([16], [6])
    # The proposer saw each step's history: the accepted tokens, never a
    # placeholder or a rejected draft.
    assert proposer.seen == [
        [10, 11, 12, 13],
        [10, 11, 12, 13, 14, 15],
        [10, 11, 12, 13, 14, 15, 16],
        [10, 11, 12, 13, 14, 15, 16, 17],
    ]
