"""AsyncScheduler driven as engine.step_pipeline drives it: step N+1 is
scheduled before step N's tokens are applied.

A fake model samples a token that depends only on the request and the
token's index, so a request's output must not depend on when its steps
were scheduled: every trace gives the outputs a synchronous run gives.
Per step: placeholders never negative and equal to the tokens in flight,
block bookkeeping exact, and no token reaches a caller after its request
finished.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from engine.config import CacheConfig, SchedulerConfig
from engine.outputs import EngineCoreOutput, ModelRunnerOutput
from engine.request import Request, RequestStatus
from engine.sched.async_scheduler import AsyncScheduler
from engine.sched.output import SchedulerOutput
from tests.unit.engine.sched.harness import EOS, make_request
from tests.unit.engine.sched.test_scheduler_properties import (
    PROPS,
    Spec,
    arrive_and_abort,
    check_invariants,
    expected_outputs,
    traces,
)


def token_at(request_id: str, index: int) -> int:
    """The fake model: EOS about one time in nine (as sample_token)."""
    rng = random.Random(f"{request_id}/{index}")
    return EOS if rng.random() < 0.11 else rng.randrange(3, 50_000)


def make_async_scheduler(**config: Any) -> AsyncScheduler:
    return AsyncScheduler(
        SchedulerConfig(
            max_num_seqs=config.get("max_num_seqs", 16),
            max_num_batched_tokens=config.get("max_num_batched_tokens", 64),
            max_model_len=config.get("max_model_len", 256),
            enable_chunked_prefill=config.get("chunked_prefill", True),
            policy=config.get("policy", "fcfs"),
            long_prefill_token_threshold=config.get("long_prefill_token_threshold", 0),
            max_num_partial_prefills=config.get("max_num_partial_prefills", 1),
            max_long_partial_prefills=config.get("max_long_partial_prefills", 1),
            async_scheduling=True,
        ),
        CacheConfig(
            block_size=config.get("block_size", 16),
            num_blocks=config.get("num_blocks", 100),
            enable_prefix_caching=config.get("prefix_caching", True),
        ),
    )


@dataclass
class _Step:
    so: SchedulerOutput
    # request id -> index of the token this step samples for it
    samples: dict[str, int]


@dataclass
class PipelinedDriver:
    """One step in flight, as StepPipeline: schedule, then apply the previous."""

    sched: AsyncScheduler
    in_flight: _Step | None = None
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)

    @property
    def scheduled(self) -> dict[str, int]:
        """The step in flight's schedule ({} when none is in flight)."""
        return dict(self.in_flight.so.num_scheduled_tokens) if self.in_flight else {}

    def step(self) -> list[EngineCoreOutput]:
        previous, self.in_flight = self.in_flight, None
        if self.sched.has_requests():
            before = {rid: r.num_output_placeholders for rid, r in self.sched.requests.items()}
            so = self.sched.schedule()
            self.in_flight = _Step(so, self._samples(so, before))
        outputs = self._apply(previous) if previous is not None else []
        self._check_placeholders()
        return outputs

    def _samples(self, so: SchedulerOutput, before: dict[str, int]) -> dict[str, int]:
        """Scheduled requests that sample: the scheduler gave them a
        placeholder; the token's index counts those before it."""
        samples = {}
        for rid in so.num_scheduled_tokens:
            req = self.sched.requests[rid]
            if req.num_output_placeholders > before.get(rid, 0):
                samples[rid] = req.num_output_tokens + req.num_output_placeholders - 1
        return samples

    def _apply(self, step: _Step) -> list[EngineCoreOutput]:
        req_ids = list(step.so.num_scheduled_tokens)
        sampled = [
            [token_at(rid, step.samples[rid])] if rid in step.samples else [] for rid in req_ids
        ]
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        outs = self.sched.update_from_output(step.so, mro)
        outputs = list(outs.outputs)
        for o in outputs:
            assert o.request_id not in self.finished, f"{o.request_id}: output after its finish"
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finished.add(o.request_id)
        return outputs

    def _check_placeholders(self) -> None:
        in_flight = self.in_flight.samples if self.in_flight is not None else {}
        for rid, req in self.sched.requests.items():
            assert req.num_output_placeholders >= 0, rid
            if not req.is_finished() and not req.discard_latest_async_tokens:
                assert req.num_output_placeholders == (1 if rid in in_flight else 0), rid


def run_async_trace(
    config: dict[str, Any], specs: list[Spec], aborts: list[tuple[int, int]]
) -> tuple[PipelinedDriver, dict[str, Request], set[str]]:
    driver = PipelinedDriver(make_async_scheduler(**config))
    sched = driver.sched
    requests: dict[str, Request] = {}
    aborted: set[str] = set()
    for step_no in range(1500):
        arrive_and_abort(sched, step_no, specs, aborts, requests, aborted)
        driver.finished |= aborted  # nothing may follow an abort either
        driver.step()
        check_invariants(sched, driver.scheduled)
        last_arrival = max(s.arrival for s in specs)
        if step_no > last_arrival and not sched.has_requests() and driver.in_flight is None:
            break
    else:
        raise AssertionError("trace did not finish")
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == config["num_blocks"] - 1
    assert sched.requests == {}
    return driver, requests, aborted


@PROPS
@given(traces())
def test_async_outputs_equal_a_synchronous_run(trace):
    config, specs, aborts = trace
    driver, requests, aborted = run_async_trace(config, specs, aborts)
    for rid, req in requests.items():
        if rid in aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED
            continue
        spec = specs[int(rid[1:])]
        expected = expected_outputs(spec, config["max_model_len"], rid)
        assert req.output_token_ids == expected
        assert driver.tokens[rid] == expected  # streamed: nothing past the stop


@given(st.integers(0, 2**16))
def test_steps_overlap_in_steady_decode(seed):
    """Decoding requests are scheduled every step although each step's
    tokens arrive one step late: no step is lost to the pipeline."""
    rng = random.Random(seed)
    sched = make_async_scheduler(max_num_batched_tokens=256)
    n = rng.randint(1, 6)
    for i in range(n):
        sched.add_request(make_request(f"r{i}", rng.randint(1, 40), max_tokens=6, ignore_eos=True))
    driver = PipelinedDriver(sched)
    driver.step()  # every prompt fits in the first step
    for _ in range(5):  # the other five tokens, one step each
        driver.step()
        assert set(driver.scheduled) == {f"r{i}" for i in range(n)}
    driver.step()  # the last token arrives; nothing more is scheduled
    assert not driver.scheduled
    assert all(len(t) == 6 for t in driver.tokens.values())


def test_no_step_past_max_tokens():
    """max_tokens=1: the prefill's token is in flight, and it is the last."""
    sched = make_async_scheduler()
    sched.add_request(make_request("r0", 20, max_tokens=1))
    driver = PipelinedDriver(sched)
    driver.step()
    assert driver.scheduled == {"r0": 20}
    driver.step()  # scheduled while the token is in flight: nothing
    assert driver.scheduled == {}
    assert driver.tokens["r0"] == [token_at("r0", 0)]


def test_finish_with_a_step_in_flight_drops_its_tokens():
    """A stop (EOS here) arrives while the next step is already scheduled:
    that step's token is never appended nor streamed."""
    sched = make_async_scheduler()
    eos_at = next(i for i in range(200) if token_at("r7", i) == EOS)
    sched.add_request(make_request("r7", 10, max_tokens=500))
    driver = PipelinedDriver(sched)
    for _ in range(eos_at + 3):
        driver.step()
    assert sched.requests == {}
    assert driver.tokens["r7"] == [token_at("r7", i) for i in range(eos_at + 1)]


def test_abort_with_a_step_in_flight():
    sched = make_async_scheduler()
    sched.add_request(make_request("r0", 10, max_tokens=50, ignore_eos=True))
    sched.add_request(make_request("r1", 10, max_tokens=5, ignore_eos=True))
    driver = PipelinedDriver(sched)
    for _ in range(3):
        driver.step()
    sched.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    driver.finished.add("r0")
    while sched.has_requests() or driver.in_flight is not None:
        driver.step()
    assert driver.tokens["r1"] == [token_at("r1", i) for i in range(5)]
    assert sched.kv_cache_manager.get_num_free_blocks() == 99


def test_preemption_with_a_step_in_flight_keeps_its_token():
    """Too few blocks for two growing requests: the later one is preempted
    while its token is in flight. The token still counts, and the request
    resumes by recomputing with it."""
    sched = make_async_scheduler(block_size=8, num_blocks=6, max_model_len=40)
    sched.add_request(make_request("r0", 14, max_tokens=20, ignore_eos=True))
    sched.add_request(make_request("r1", 14, max_tokens=20, ignore_eos=True))
    driver = PipelinedDriver(sched)
    for _ in range(200):
        if not sched.has_requests() and driver.in_flight is None:
            break
        driver.step()
    assert sched.num_preemptions > 0
    for rid in ("r0", "r1"):
        assert driver.tokens[rid] == [token_at(rid, i) for i in range(20)]


def test_reset_prefix_cache_with_running_requests_discards_the_token_in_flight():
    sched = make_async_scheduler()
    sched.add_request(make_request("r0", 10, max_tokens=8, ignore_eos=True))
    driver = PipelinedDriver(sched)
    for _ in range(3):
        driver.step()
    assert sched.requests["r0"].num_output_placeholders == 1
    assert sched.reset_prefix_cache(reset_running_requests=True)
    req = sched.requests["r0"]
    assert req.num_output_placeholders == 0 and req.discard_latest_async_tokens
    while sched.has_requests() or driver.in_flight is not None:
        driver.step()
    # The discarded token is sampled again after the recomputation.
    assert driver.tokens["r0"] == [token_at("r0", i) for i in range(8)]


def _scheduler_with_a_constrained_request() -> tuple[AsyncScheduler, Request]:
    """An AsyncScheduler whose grammar backend allows SEQUENCE then EOS
    (test_scheduler_structured_output's double), and one constrained
    request whose grammar has compiled."""
    from engine.sched.grammars import SchedulerGrammars
    from engine.structured_output.manager import StructuredOutputManager
    from tests.unit.engine.sched.test_scheduler_structured_output import (
        Backend,
        _constrained,
        _wait_compiled,
    )

    sched = make_async_scheduler()
    backend = Backend()
    sched.grammars = SchedulerGrammars(StructuredOutputManager(lambda: backend))
    request = _constrained("r0", max_tokens=5)
    sched.add_request(request)
    _wait_compiled(request)
    return sched, request


def test_structured_output_masks_wait_for_the_token_in_flight():
    """A constrained request with a token in flight: its mask is left for
    fill_grammar_bitmask, which the pipeline calls after that token
    advanced the grammar; the mask then allows the grammar's next token."""
    from tests.unit.engine.sched.test_scheduler_structured_output import SEQUENCE, _grammar

    sched, request = _scheduler_with_a_constrained_request()
    first = sched.schedule()
    assert first.grammar_bitmask is not None and not first.pending_grammar
    second = sched.schedule()  # the prefill's token is still in flight
    assert second.grammar_bitmask is None
    assert second.pending_grammar == [request.request_id]
    mro = ModelRunnerOutput(["r0"], {"r0": 0}, [[SEQUENCE[0]]])
    sched.update_from_output(first, mro)
    assert _grammar(request).accepted == [SEQUENCE[0]]
    sched.fill_grammar_bitmask(second)
    assert second.grammar_bitmask is not None and not second.pending_grammar
    row = second.grammar_bitmask.bitmask[0]
    allowed = [t for t in range(2048) if row[t // 32] >> (t % 32) & 1]
    assert allowed == [SEQUENCE[1]]


def test_a_request_that_ended_meanwhile_gets_no_mask_row():
    """fill_grammar_bitmask after the constrained request was aborted while
    its token was in flight: no row (its tokens from that step are dropped)."""
    sched, request = _scheduler_with_a_constrained_request()
    sched.schedule()
    second = sched.schedule()
    assert second.pending_grammar == [request.request_id]
    sched.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    sched.fill_grammar_bitmask(second)
    assert second.grammar_bitmask is None and not second.pending_grammar


def test_a_failed_load_voids_the_step_in_flight():
    """A sync KV load reports a lost block while the request's next step is
    already scheduled: both steps' tokens are void (placeholders cleared,
    the in-flight output discarded), the request recomputes from the
    block, and its output is what it would have been without the loss."""
    from engine.outputs import KVConnectorOutput
    from tests.unit.engine.sched.fake_connector import FakeConnector

    sched = AsyncScheduler(
        SchedulerConfig(max_num_batched_tokens=256, max_model_len=256, async_scheduling=True),
        CacheConfig(block_size=16, num_blocks=100),
        connector=FakeConnector({"r0": 32}),
    )
    sched.add_request(make_request("r0", 50))
    r0 = sched.requests["r0"]
    first = sched.schedule()  # 18 computed after 32 loaded: samples
    second = sched.schedule()  # the sampled token's step, in flight
    assert r0.num_output_placeholders == 2

    def output(so: SchedulerOutput, invalid: set[int]) -> ModelRunnerOutput:
        return ModelRunnerOutput(
            ["r0"],
            {"r0": 0},
            [[token_at("r0", 0)]],  # both void: the request's first token
            kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid),
        )

    sched.update_from_output(first, output(first, {2}))  # r0's second, loaded block
    assert r0.num_output_placeholders == 0 and r0.discard_latest_async_tokens
    assert r0.num_computed_tokens == 16
    outs = sched.update_from_output(second, output(second, set()))
    assert not any(o.new_token_ids for o in outs.outputs)
    assert not r0.discard_latest_async_tokens and r0.output_token_ids == []
    driver = PipelinedDriver(sched)
    while sched.has_requests() or driver.in_flight is not None:
        driver.step()
    assert r0.output_token_ids == [token_at("r0", i) for i in range(4)]
    assert driver.tokens["r0"] == r0.output_token_ids
