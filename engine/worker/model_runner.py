"""ModelRunner: turns one SchedulerOutput into one forward pass and samples.

Per step: apply the scheduler's deltas to the persistent batch, build
positions / slot mapping / block table with numpy gathers, run the model
with paged attention, compute logits only for the rows that sample, and
sample. Requests still mid-prefill sample nothing. A request that asked
for prompt logprobs also gets logits at its prompt positions
(engine/worker/prompt_logprobs.py). With speculative decoding a request
verifying k drafts has logits at its last k + 1 positions, verified in
engine/worker/spec_verify.py; after sampling, the proposer drafts the next
step's tokens (``take_draft_token_ids``). With LoRA, rows are grouped by
adapter and the step's segments set on the model while it runs
(``_forward``), each adapter put in a device slot first (engine/lora/slots.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt
import torch

from engine.kv_cache.groups import KVCacheGroups
from engine.kv_transfer.base import KVConnectorBase
from engine.lora.slots import LoRASlots
from engine.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    DraftTokenIds,
    KVConnectorOutput,
    LogprobsLists,
    ModelRunnerOutput,
    PromptLogprobs,
)
from engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine.spec_decode.proposer import ProposeInputs, Proposer
from engine.spec_decode.rejection import DraftRows
from engine.structured_output.manager import GrammarBitmask
from engine.worker.cuda_graphs import (
    DecodeGraphs,
    DecodeRows,
    Forward,
    GraphCapture,
    StaticInputs,
)
from engine.worker.input_batch import CachedRequestState, InputBatch
from engine.worker.penalties import TokenHistory
from engine.worker.prompt_logprobs import PromptLogprobsTracker
from engine.worker.sampler import Sampler, SamplingTensors
from engine.worker.spec_verify import verify_drafts
from kernels.lora import LoRABatch, LoRASegment
from kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    # Imported when a constrained request samples: it loads xgrammar.
    from engine.structured_output.apply import DeviceBitmask


class CausalLM(Protocol):
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        layer_metas: Sequence[AttentionMetadata] | None = None,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class HostIds:
    """The step's one device-to-host copy, the sampled ids: into pinned
    memory without blocking, then one wait on an event for that copy alone
    (``tolist()`` would copy into pageable memory, staged and slower)."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.buffer = torch.empty(max_rows, dtype=torch.int64, pin_memory=True)
            self.copied = torch.cuda.Event()  # type: ignore[no-untyped-call]

    def read(self, ids: torch.Tensor) -> list[int]:
        if not self.cuda or ids.numel() > self.buffer.numel():
            values: list[int] = ids.tolist()
            return values
        host = self.buffer[: ids.numel()]
        host.copy_(ids, non_blocking=True)
        self.copied.record()
        self.copied.synchronize()
        out: list[int] = host.tolist()
        return out


def forward_over(
    model: CausalLM, kv_caches: list[torch.Tensor], layer_group: Sequence[int]
) -> Forward:
    """``forward(input_ids, positions, metas)``: the model over these caches,
    ``metas`` one per KV cache group (``layer_group[l]``: layer l's)."""

    def forward(
        input_ids: torch.Tensor, positions: torch.Tensor, metas: list[AttentionMetadata]
    ) -> torch.Tensor:
        layer_metas = [metas[g] for g in layer_group] if len(metas) > 1 else None
        return model(input_ids, positions, kv_caches, metas[0], layer_metas)

    return forward


@dataclass(frozen=True)
class StepInputs:
    """Host-side arrays for one forward pass, before the copy to the device."""

    input_ids: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    slot_mapping: npt.NDArray[np.int64]  # [KV cache groups, tokens]
    query_start_loc: npt.NDArray[np.int32]
    seq_lens: npt.NDArray[np.int32]
    # Per request: how many of its scheduled tokens are prompt tokens (the
    # first ones; AttentionMetadata.prompt_rows).
    prompt_rows: npt.NDArray[np.int64]
    # Rows (batch indices) that sample this step and the token rows whose
    # logits they need: one each, or 1 + k for a row verifying k drafts.
    sample_rows: npt.NDArray[np.int64]
    logits_indices: npt.NDArray[np.int64]
    # Per sampling row, its scheduled drafts and its first logits row;
    # None when no row has any.
    drafts: DraftRows | None
    max_query_len: int
    max_seq_len: int


@dataclass
class _DraftPlan:
    """The step as this runner runs it: ``num_scheduled`` and ``drafts``
    are the scheduler's, except for requests whose drafts were
    placeholders (``placeholders``: how many the scheduler planned), which
    run only the drafts this runner proposed."""

    num_scheduled: dict[str, int]
    drafts: dict[str, list[int]]
    placeholders: dict[str, int] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        *,
        block_size: int,
        max_num_reqs: int,
        max_model_len: int,
        device: torch.device,
        kv_groups: KVCacheGroups | None = None,
    ) -> None:
        """``kv_groups``: which block table each layer uses (None: one
        table for every layer)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_groups = kv_groups or KVCacheGroups.single(len(kv_caches))
        self._run_model = forward_over(model, kv_caches, self.kv_groups.layer_group)
        max_blocks = -(-max_model_len // block_size)
        self.batch = InputBatch(max_num_reqs, max_model_len, max_blocks, self.kv_groups.num_groups)
        self.sampler = Sampler()
        self.prompt_logprobs = PromptLogprobsTracker()
        # The worker-role KV connector, if any (set by attach_connector).
        self.connector: KVConnectorBase | None = None
        # Speculative decoding (set by attach_proposer): who drafts, how
        # many tokens at most, and the drafts of the last step.
        self.proposer: Proposer | None = None
        self.num_spec_tokens = 0
        self._drafts: DraftTokenIds | None = None
        # Asynchronous scheduling: the last step's rejected drafts per
        # request, for a step the scheduler planned before seeing them.
        self._rejected: dict[str, int] = {}
        # This step's token counts and drafts as the runner runs them.
        self._plan = _DraftPlan({}, {})
        # LoRA adapters' device slots (set by attach_lora); None: LoRA off.
        self.lora: LoRASlots | None = None
        self._host_ids = HostIds(max_num_reqs, device)
        # Captured decode forwards (attach_graphs); None: every step eager.
        self.graphs: DecodeGraphs | None = None
        self.max_model_len = max_model_len

    @property
    def _no_blocks(self) -> tuple[list[int], ...]:
        return tuple([] for _ in range(self.kv_groups.num_groups))

    def attach_lora(self, slots: LoRASlots) -> None:
        self.lora = slots

    def attach_graphs(self, capture: GraphCapture, sizes: Sequence[int]) -> None:
        """Captures the decode forward at each size (engine/worker/cuda_graphs.py);
        from then on, steps of decode rows that fit one replay it."""
        groups, width = self.batch.num_kv_groups, self.batch.max_blocks_per_req
        inputs = StaticInputs(max(sizes), groups, width, self.device)
        graphs = DecodeGraphs(self._run_model, sizes, inputs, self.max_model_len)
        with torch.inference_mode():
            graphs.capture_all(capture)
        self.graphs = graphs

    def attach_proposer(self, proposer: Proposer, num_spec_tokens: int) -> None:
        self.proposer = proposer
        self.num_spec_tokens = num_spec_tokens

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts proposed after the last step (once), for the scheduler."""
        drafts, self._drafts = self._drafts, None
        return drafts

    def attach_connector(self, connector: KVConnectorBase) -> None:
        connector.register_kv_caches({f"layer.{i}": c for i, c in enumerate(self.kv_caches)})
        self.connector = connector

    # ------------------------------------------------------------------
    # Applying the scheduler's deltas
    # ------------------------------------------------------------------

    def update_states(self, so: SchedulerOutput) -> None:
        batch = self.batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self.prompt_logprobs.remove(req_id)
            batch.remove(req_id)
            if self.proposer is not None:
                self.proposer.remove(req_id)
        # Rows are only for this step's requests; the others keep their
        # state in self.requests (preempted, or skipped this step).
        for req_id in [r for r in batch.req_ids if r not in so.num_scheduled_tokens]:
            batch.remove(req_id)
        for new in so.scheduled_new_reqs:
            self._add_new_request(new)
        self._apply_cached(so.scheduled_cached_reqs)
        if self.lora is not None:
            batch.group_by_lora()  # before drafts go in past the tokens
        if self.proposer is not None:
            self._reset_proposer(so)
        self._plan = self._plan_drafts(so)
        for req_id, drafts in self._plan.drafts.items():
            batch.set_drafts(batch.req_id_to_index[req_id], drafts)

    def _plan_drafts(self, so: SchedulerOutput) -> _DraftPlan:
        """The drafts this step verifies. Placeholders (asynchronous
        scheduling: the scheduler planned k drafts before they existed) are
        replaced by what this runner proposed after the last step
        (``_drafts``, which nobody takes then), and only those are run:
        a request the proposer found nothing for decodes one token, as it
        would synchronously, instead of verifying k padding tokens."""
        spec = so.scheduled_spec_decode_tokens
        if not any(d and d[0] < 0 for d in spec.values()):
            return _DraftPlan(so.num_scheduled_tokens, spec)
        last = self._drafts
        proposed = dict(zip(last.req_ids, last.draft_token_ids, strict=True)) if last else {}
        plan = _DraftPlan(dict(so.num_scheduled_tokens), dict(spec))
        for req_id, drafts in spec.items():
            if drafts and drafts[0] < 0:
                own = list(proposed.get(req_id, ()))[: len(drafts)]
                plan.drafts[req_id] = own
                plan.num_scheduled[req_id] -= len(drafts) - len(own)
                plan.placeholders[req_id] = len(drafts)
        return plan

    def _reset_proposer(self, so: SchedulerOutput) -> None:
        """New and resumed requests: their KV is valid up to the prefix-cache
        hit (a connector's tokens carry no draft model KV)."""
        assert self.proposer is not None
        for new in so.scheduled_new_reqs:
            valid = max(0, new.num_computed_tokens - new.num_external_tokens)
            self.proposer.reset(new.req_id, valid)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids:
                self.proposer.reset(req_id, cached.num_computed_tokens[i])

    def _add_new_request(self, new: NewRequestData) -> None:
        params = new.sampling_params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        state = CachedRequestState(
            req_id=new.req_id,
            token_ids=list(new.prompt_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids),
            sampling_params=params,
            generator=generator,
            block_ids=tuple(list(ids) for ids in new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            num_output_tokens_in_prompt=new.num_output_tokens_in_prompt,
            lora_int_id=new.lora_request.lora_int_id if new.lora_request is not None else 0,
        )
        self.requests[new.req_id] = state
        self.prompt_logprobs.add(new.req_id, params.prompt_logprobs, state.num_prompt_tokens)
        self.batch.remove(new.req_id)  # a re-sent request replaces its old row
        self.batch.add(state)

    def _apply_cached(self, data: CachedRequestData) -> None:
        batch = self.batch
        rejected = self._rejected
        for i, req_id in enumerate(data.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = data.num_computed_tokens[i]
            if rejected and req_id in data.in_flight_req_ids:
                state.num_computed_tokens -= rejected.get(req_id, 0)
            new_blocks = data.new_block_ids[i]
            if req_id in data.resumed_req_ids:
                state.block_ids = tuple(list(ids) for ids in new_blocks or self._no_blocks)
            elif new_blocks:
                for held, ids in zip(state.block_ids, new_blocks, strict=True):
                    held.extend(ids)
            all_tokens = data.all_token_ids.get(req_id)
            if all_tokens is not None:
                state.token_ids = list(all_tokens)
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                batch.add(state)
                continue
            batch.num_computed_tokens[row] = state.num_computed_tokens
            if req_id in data.resumed_req_ids or all_tokens is not None:
                batch.set_blocks(row, state.block_ids)
                batch.set_tokens(row, state.token_ids)
            elif new_blocks:
                batch.append_blocks(row, new_blocks)

    # ------------------------------------------------------------------
    # Building inputs
    # ------------------------------------------------------------------

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        batch = self.batch
        n = batch.num_reqs
        scheduled = self._plan.num_scheduled
        num_sched = np.fromiter((scheduled[r] for r in batch.req_ids), np.int64, n)
        cu = np.cumsum(num_sched)
        total = int(cu[-1])
        req_idx = np.repeat(np.arange(n), num_sched)
        # Offset of each token within its request's chunk.
        offsets = np.arange(total) - np.repeat(cu - num_sched, num_sched)
        computed = batch.num_computed_tokens[:n]
        positions = computed[req_idx] + offsets
        input_ids = batch.token_ids[req_idx, positions]
        block_ids = batch.block_tables[:, req_idx, positions // self.block_size]
        # C order: each group's row goes to the device as one contiguous run.
        slot_mapping = np.ascontiguousarray(
            block_ids.astype(np.int64) * self.block_size + positions % self.block_size
        )
        seq_lens = computed + num_sched
        prompt_rows = np.clip(batch.output_start[:n] - computed, 0, num_sched)
        # A row samples once its chunk reaches the last token it knows.
        sample_rows = np.flatnonzero(seq_lens >= batch.num_tokens[:n])
        query_start_loc = np.zeros(n + 1, np.int32)
        query_start_loc[1:] = cu
        logits_indices = cu[sample_rows] - 1
        drafts = None
        spec = self._plan.drafts
        if any(spec.values()):
            # A row verifying k drafts needs the logits of its last k + 1 tokens.
            drafts = DraftRows.build([spec.get(batch.req_ids[r], []) for r in sample_rows.tolist()])
            counts = np.array([len(d) + 1 for d in drafts.drafts], np.int64)
            ends = np.repeat(cu[sample_rows], counts)
            back = np.repeat(np.cumsum(counts), counts) - np.arange(drafts.num_logits_rows)
            logits_indices = ends - back
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens.astype(np.int32),
            prompt_rows=prompt_rows,
            sample_rows=sample_rows,
            logits_indices=logits_indices,
            drafts=drafts,
            max_query_len=int(num_sched.max()),
            max_seq_len=int(seq_lens.max()),
        )

    def _as_token_rows(self, inputs: StepInputs) -> bool:
        """Whether the step runs as decode rows, one per token: a decode,
        or a verification of drafts (``_token_rows_metadata``)."""
        if inputs.max_query_len == 1:
            return True
        return inputs.drafts is not None and inputs.max_query_len <= 1 + self.num_spec_tokens

    def _attention_metadata(self, inputs: StepInputs) -> list[AttentionMetadata]:
        """The step's attention metadata, one per KV cache group (they
        differ only in block table and slot mapping)."""
        if inputs.max_query_len > 1 and self._as_token_rows(inputs):
            return self._token_rows_metadata(inputs)
        n = self.batch.num_reqs
        max_blocks = -(-inputs.max_seq_len // self.block_size)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(inputs.slot_mapping[0]).to(dev, non_blocking=True),
            query_start_loc=torch.from_numpy(inputs.query_start_loc).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(inputs.seq_lens).to(dev, non_blocking=True),
            block_table=torch.from_numpy(self.batch.block_table[:n, :max_blocks]).to(
                dev, non_blocking=True
            ),
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
            # A prompt token alone in its chunk still takes the prefill kernels.
            decode_only=inputs.max_query_len == 1 and not inputs.prompt_rows.any(),
            prompt_rows=tuple(inputs.prompt_rows.tolist()),
        )
        return self._per_group(meta, inputs, np.arange(n), max_blocks)

    def _token_rows_metadata(self, inputs: StepInputs) -> list[AttentionMetadata]:
        """A verification step as a decode batch of one row per token: token
        ``j`` of a chunk attends to its context up to its own position, as
        in the chunk (all of a layer's KV is written before attention reads
        it), so every token takes the decode kernels (on the CPU, the
        compiled decode stack) instead of the prefill path."""
        dev = self.device
        lens = np.diff(inputs.query_start_loc)
        req_idx = np.repeat(np.arange(lens.size), lens)
        max_blocks = -(-inputs.max_seq_len // self.block_size)
        table = self.batch.block_table[req_idx, :max_blocks]
        rows = inputs.positions.size
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(inputs.slot_mapping[0]).to(dev, non_blocking=True),
            query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.from_numpy((inputs.positions + 1).astype(np.int32)).to(dev),
            block_table=torch.from_numpy(table).to(dev, non_blocking=True),
            max_query_len=1,
            max_seq_len=inputs.max_seq_len,
            decode_only=True,
        )
        return self._per_group(meta, inputs, req_idx, max_blocks)

    def _per_group(
        self,
        meta: AttentionMetadata,
        inputs: StepInputs,
        table_rows: npt.NDArray[np.int64],
        max_blocks: int,
    ) -> list[AttentionMetadata]:
        """``meta`` (group 0's) and each further group's copy with its own
        block table rows and slot mapping."""
        metas = [meta]
        dev = self.device
        for g in range(1, self.kv_groups.num_groups):
            table = self.batch.block_tables[g][table_rows, :max_blocks]
            metas.append(
                replace(
                    meta,
                    slot_mapping=torch.from_numpy(inputs.slot_mapping[g]).to(dev),
                    block_table=torch.from_numpy(table).to(dev),
                )
            )
        return metas

    # ------------------------------------------------------------------
    # The step
    # ------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        connector = self.connector
        if connector is None:
            return self._execute(so)
        # Loads land before the forward reads them; saves copy out after it.
        if so.kv_connector_metadata is not None:
            connector.bind_connector_metadata(so.kv_connector_metadata)
        connector.start_load_kv()
        try:
            output = self._execute(so)
            connector.wait_for_save()
            sending, recving = connector.get_finished(so.finished_req_ids)
            kv_output = KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                invalid_block_ids=connector.get_block_ids_with_load_errors(),
                stats=connector.take_stats(),
            )
        finally:
            connector.clear_connector_metadata()
        if kv_output.is_empty():
            return output
        if output is EMPTY_MODEL_RUNNER_OUTPUT:
            output = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        output.kv_connector_output = kv_output
        return output

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(so)
        self._rejected = {}
        if so.total_num_scheduled_tokens == 0 or self.batch.num_reqs == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        inputs = self.prepare_inputs(so)
        dev = self.device
        # Before the forward is queued: building them copies to the device,
        # which on CUDA would otherwise wait for the forward to finish.
        sampling = None
        if inputs.sample_rows.size and inputs.drafts is None:
            sampling = self._sampling_tensors(inputs.sample_rows)
        grammar = None
        if so.grammar_bitmask is not None and inputs.sample_rows.size:
            grammar = self._grammar_mask(inputs, so.grammar_bitmask)
        lora = self._lora_batch(inputs)
        hidden = self._replay(inputs) if lora is None else None
        if hidden is None:
            metas = self._attention_metadata(inputs)
            input_ids = torch.from_numpy(inputs.input_ids).to(dev, non_blocking=True)
            positions = torch.from_numpy(inputs.positions).to(dev, non_blocking=True)
            hidden = self._forward(input_ids, positions, metas, lora)
        prompt_logprobs = self._prompt_logprobs(hidden, inputs, so)
        sampled: list[list[int]] = [[] for _ in range(self.batch.num_reqs)]
        logprobs = None
        if inputs.sample_rows.size:
            logits_idx = torch.from_numpy(inputs.logits_indices).to(dev, non_blocking=True)
            logits = self.model.compute_logits(hidden[logits_idx])
            if grammar is not None:
                from engine.structured_output.apply import apply_device_bitmask

                apply_device_bitmask(logits, grammar)
            if sampling is not None:
                sampled, logprobs = self._sample(logits, sampling, inputs.sample_rows, sampled)
            else:
                sampled, logprobs = self._verify(logits, inputs, sampled)
            if self._plan.placeholders:
                self._count_unused_placeholders(sampled)
            if self.proposer is not None:
                self._propose(inputs.sample_rows)
        batch = self.batch
        plan = self._plan
        return ModelRunnerOutput(
            req_ids=list(batch.req_ids),
            req_id_to_index=dict(batch.req_id_to_index),
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs_dict=prompt_logprobs,
            num_verified_drafts={r: len(plan.drafts[r]) for r in plan.placeholders} or None,
        )

    def _replay(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step's hidden states from a captured graph, or None when it
        is not decode rows or no graph holds them (it then runs eagerly)."""
        if self.graphs is None or not self._as_token_rows(inputs):
            return None
        lens = np.diff(inputs.query_start_loc)
        rows = DecodeRows(
            input_ids=inputs.input_ids,
            positions=inputs.positions,
            slot_mapping=inputs.slot_mapping,
            table_rows=np.repeat(np.arange(lens.size), lens),
            max_blocks=-(-inputs.max_seq_len // self.block_size),
        )
        return self.graphs.run(rows, self.batch)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metas: list[AttentionMetadata],
        lora: LoRABatch | None,
    ) -> torch.Tensor:
        """The model's forward, with the step's LoRA rows set while it runs."""
        if lora is None:
            return self._run_model(input_ids, positions, metas)
        assert self.lora is not None
        self.lora.state.batch = lora
        try:
            return self._run_model(input_ids, positions, metas)
        finally:
            self.lora.state.batch = None

    def _lora_batch(self, inputs: StepInputs) -> LoRABatch | None:
        """The step's adapter segments (rows are grouped by adapter), with
        each adapter put in a device slot; None when no row has one."""
        if self.lora is None:
            return None
        ids = [state.lora_int_id for state in self.batch.states]
        if not any(ids):
            return None
        slots = self.lora.activate(sorted(set(ids) - {0}))
        starts = inputs.query_start_loc
        segments = []
        row = 0
        while row < len(ids):
            end = row
            while end < len(ids) and ids[end] == ids[row]:
                end += 1
            if ids[row]:
                segments.append(LoRASegment(int(starts[row]), int(starts[end]), slots[ids[row]]))
            row = end
        return LoRABatch(segments, int(starts[-1]))

    def _prompt_logprobs(
        self, hidden: torch.Tensor, inputs: StepInputs, so: SchedulerOutput
    ) -> dict[str, PromptLogprobs]:
        if not self.prompt_logprobs:
            return {}  # the common case costs one truth test
        return self.prompt_logprobs.compute(
            hidden,
            self.batch,
            inputs.query_start_loc,
            self._plan.num_scheduled,
            self.model.compute_logits,
        )

    def _grammar_mask(self, inputs: StepInputs, grammar: GrammarBitmask) -> DeviceBitmask | None:
        """Structured output: the step's mask rows against its logits rows,
        on the device before the forward is queued. The sampler then sees
        forbidden tokens of the constrained rows at -inf (so greedy,
        temperature, top-k/p all choose among allowed tokens, and logprobs
        show the mask). A row verifying drafts has a mask per position."""
        # Here, not at the top: xgrammar loads once a constrained request samples.
        from engine.structured_output.apply import device_bitmask

        req_ids = self.batch.req_ids
        rows = inputs.sample_rows.tolist()
        starts = range(len(rows)) if inputs.drafts is None else inputs.drafts.starts
        first_row = {req_ids[r]: s for r, s in zip(rows, starts, strict=True)}
        num_rows = len(rows) if inputs.drafts is None else inputs.drafts.num_logits_rows
        return device_bitmask(grammar, first_row, num_rows, self.device)

    def _verify(
        self, logits: torch.Tensor, inputs: StepInputs, sampled: list[list[int]]
    ) -> tuple[list[list[int]], LogprobsLists | None]:
        """Speculative decoding: accept drafts, append what the step yields."""
        assert inputs.drafts is not None
        batch = self.batch
        result = verify_drafts(logits, batch, inputs.sample_rows, inputs.drafts, self.device)
        for row, tokens in zip(inputs.sample_rows.tolist(), result.tokens, strict=True):
            sampled[row] = tokens
            batch.states[row].token_ids.extend(tokens)
            batch.append_tokens(row, tokens)
        return sampled, result.logprobs

    def _count_unused_placeholders(self, sampled: list[list[int]]) -> None:
        """Asynchronous scheduling: the scheduler planned the next step as
        if all of this step's placeholder drafts were computed and accepted;
        what was not (rejected, or never run) is taken off then."""
        index = self.batch.req_id_to_index
        for req_id, num_planned in self._plan.placeholders.items():
            tokens = sampled[index[req_id]]
            if tokens and len(tokens) <= num_planned:
                self._rejected[req_id] = num_planned + 1 - len(tokens)

    def _propose(self, sample_rows: npt.NDArray[np.int64]) -> None:
        """Drafts for the rows that sampled, for the scheduler's next step;
        none past a request's max_tokens (they could not be used)."""
        assert self.proposer is not None
        if not sample_rows.size:
            return
        batch = self.batch
        states = [batch.states[r] for r in sample_rows.tolist()]
        max_tokens = np.fromiter((s.sampling_params.max_tokens for s in states), np.int64)
        left = max_tokens - (batch.num_tokens[sample_rows] - batch.output_start[sample_rows])
        caps = np.clip(left - 1, 0, self.num_spec_tokens)
        drafts = self.proposer.propose(ProposeInputs(batch, sample_rows, caps))
        self._drafts = DraftTokenIds([s.req_id for s in states], drafts)

    def _sampling_tensors(self, sample_rows: npt.NDArray[np.int64]) -> SamplingTensors:
        batch = self.batch
        states = [batch.states[r] for r in sample_rows.tolist()]
        # Views of the batch (no copy): read only when a row has a penalty.
        history = TokenHistory(batch.token_ids, batch.num_tokens, batch.output_start, sample_rows)
        return SamplingTensors.from_params(
            [s.sampling_params for s in states], [s.generator for s in states], self.device, history
        )

    def _sample(
        self,
        logits: torch.Tensor,
        tensors: SamplingTensors,
        sample_rows: npt.NDArray[np.int64],
        sampled: list[list[int]],
    ) -> tuple[list[list[int]], LogprobsLists | None]:
        batch = self.batch
        rows = sample_rows.tolist()
        states = [batch.states[r] for r in rows]
        result = self.sampler(logits, tensors)
        token_ids = self._host_ids.read(result.sampled)
        for row, state, token_id in zip(rows, states, token_ids, strict=True):
            sampled[row] = [token_id]
            state.token_ids.append(token_id)
            batch.append_token(row, token_id)
        logprobs = None
        if result.logprobs is not None:
            per_row = [s.sampling_params.logprobs or 0 for s in states]
            logprobs = result.logprobs.to_lists(per_row)
            # Rows without a sample (mid-prefill) own no logprob row.
            cu = np.zeros(batch.num_reqs + 1, np.int64)
            cu[sample_rows + 1] = 1
            logprobs.cu_num_generated_tokens = np.cumsum(cu).tolist()
        return sampled, logprobs

    @torch.inference_mode()
    def warmup(self) -> None:
        """One throwaway prefill of a block's worth of tokens, so first-use
        costs (kernel compilation, allocator growth) are not paid by the first
        request. It writes only into the null block, which no request reads."""
        n = self.block_size
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            block_table=torch.zeros((1, 1), dtype=torch.int32, device=dev),
            max_query_len=n,
            max_seq_len=n,
        )
        ids = torch.zeros(n, dtype=torch.int64, device=dev)
        hidden = self.model(ids, torch.arange(n, device=dev), self.kv_caches, meta)
        self.model.compute_logits(hidden[-1:])
        for cache in self.kv_caches:
            cache[:, 0].zero_()
