"""Property-based tests over random traces (hypothesis).

Every step: the token budget and max_num_seqs hold, and block bookkeeping is
exact (ref counts equal holders, only prefix-cached blocks are shared, the
free queue holds exactly the unreferenced blocks; with sliding-window KV
cache groups, every block the next token can read is still held). At the end: every block is
free and every request got exactly max_tokens tokens unless it stopped or
was aborted. With a connector double that loads KV (sync or async) and
randomly reports invalid blocks, outputs equal a failure-free run.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv_cache.groups import blocks_held
from engine.outputs import KVConnectorOutput
from engine.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler
from tests.unit.engine.sched.fake_connector import FakeConnector
from tests.unit.engine.sched.harness import EOS, make_request, make_scheduler, step

PREFIXES = [list(range(1000 + 100 * i, 1000 + 100 * i + 80)) for i in range(3)]


@dataclass
class Spec:
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    priority: int
    arrival: int
    ignore_eos: bool


def spec_strategy(max_model_len: int) -> st.SearchStrategy[Spec]:
    return st.builds(
        lambda prefix, plen, suffix, max_tokens, min_frac, prio, arrival, ignore: Spec(
            ([] if prefix is None else PREFIXES[prefix][:plen]) + suffix,
            max_tokens,
            int(max_tokens * min_frac),
            prio,
            arrival,
            ignore,
        ),
        st.one_of(st.none(), st.integers(0, 2)),
        st.integers(0, min(80, max_model_len - 2)),
        st.lists(st.integers(3, 999), min_size=1, max_size=max_model_len // 2),
        st.integers(1, 12),
        st.sampled_from([0.0, 0.5]),
        st.integers(0, 3),
        st.integers(0, 6),
        st.booleans(),
    ).filter(lambda s: len(s.prompt) <= max_model_len)


WINDOWED_GROUPS = [(None, 8), (12,), (None, 20, 20)]


@st.composite
def traces(
    draw: st.DrawFn, windowed: bool = False
) -> tuple[dict[str, Any], list[Spec], list[tuple[int, int]]]:
    block_size = draw(st.sampled_from([8, 16]))
    max_model_len = draw(st.integers(24, 96))
    chunked = draw(st.booleans())
    budget = draw(st.integers(8, 160)) if chunked else draw(st.integers(max_model_len, 200))
    groups = draw(st.sampled_from(WINDOWED_GROUPS)) if windowed else (None,)
    min_blocks = 1 + sum(blocks_held(max_model_len, block_size, w, budget) for w in groups)
    partial = draw(st.integers(1, 3)) if chunked else 1
    config = {
        "block_size": block_size,
        "num_blocks": draw(st.integers(min_blocks, min_blocks + 30)),
        "max_num_seqs": draw(st.integers(1, 8)),
        "max_num_batched_tokens": budget,
        "max_model_len": max_model_len,
        "prefix_caching": draw(st.booleans()),
        "chunked_prefill": chunked,
        "policy": draw(st.sampled_from(["fcfs", "priority"])),
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 8, 24])),
        "max_num_partial_prefills": partial,
        "max_long_partial_prefills": draw(st.integers(1, partial)),
        "group_windows": groups,
    }
    specs = draw(st.lists(spec_strategy(max_model_len), min_size=1, max_size=10))
    aborts = draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 9)), max_size=3))
    return config, specs, aborts


def sample_token(request: Request) -> int:
    """Deterministic per (request, position); EOS about one time in nine."""
    rng = random.Random(f"{request.request_id}/{len(request.output_token_ids)}")
    return EOS if rng.random() < 0.11 else rng.randrange(3, 50_000)


def check_invariants(sched: Scheduler, scheduled: dict[str, int]) -> None:
    cfg = sched.config
    assert sum(scheduled.values()) <= cfg.max_num_batched_tokens
    assert all(n > 0 for n in scheduled.values())
    assert len(scheduled) <= cfg.max_num_seqs
    assert len(sched.running) <= cfg.max_num_seqs
    kvm = sched.kv_cache_manager
    holders: Counter[int] = Counter()
    for req_id, groups in kvm.req_to_blocks.items():
        if groups[0]:
            request = sched.requests[req_id]
            assert not request.is_finished(), f"{req_id} finished but holds blocks"
            check_window_held(request, groups, kvm.group_windows, kvm.block_size)
        held = [b.block_id for blocks in groups for b in blocks if not b.is_null]
        assert len(set(held)) == len(held)
        holders.update(held)
    pool = kvm.block_pool
    free_ids = {b.block_id for b in pool.free_queue.get_all_free_blocks()}
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], block
        if block.ref_cnt > 1:
            assert block.block_hash is not None, f"block {block.block_id} shared but not cached"
        assert (block.ref_cnt == 0) == (block.block_id in free_ids)
    assert pool.get_num_free_blocks() == len(free_ids)


def check_window_held(
    request: Request,
    groups: tuple[list[Any], ...],
    windows: tuple[int | None, ...],
    block_size: int,
) -> None:
    """Every group holds a real block wherever the next token can read."""
    for blocks, window in zip(groups, windows, strict=True):
        reach = 0 if window is None else request.num_computed_tokens - (window - 1)
        first = max(0, reach) // block_size
        assert not any(b.is_null for b in blocks[first:]), (request.request_id, window)


def arrive_and_abort(
    sched: Scheduler,
    step_no: int,
    specs: list[Spec],
    aborts: list[tuple[int, int]],
    requests: dict[str, Request],
    aborted: set[str],
) -> None:
    """The trace's events before step ``step_no``: arrivals, then aborts
    (recorded in ``requests`` and ``aborted``)."""
    for i, spec in enumerate(specs):
        if spec.arrival == step_no:
            req = make_request(
                f"r{i}",
                spec.prompt,
                max_tokens=spec.max_tokens,
                min_tokens=spec.min_tokens,
                priority=spec.priority,
                # Distinct, as a real clock's: with ties the priority policy's
                # victim choice (vLLM's too) can preempt two requests in turn
                # forever.
                arrival_time=spec.arrival + i / 1000,
                ignore_eos=spec.ignore_eos,
            )
            requests[req.request_id] = req
            sched.add_request(req)
    for at, idx in aborts:
        rid = f"r{idx}"
        if at == step_no and rid in requests and not requests[rid].is_finished():
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            aborted.add(rid)


def run_trace(
    config: dict[str, Any],
    specs: list[Spec],
    aborts: list[tuple[int, int]],
    connector: FakeConnector | None = None,
    faults: Faults | None = None,
):
    sched = make_scheduler(connector=connector, **config)
    requests: dict[str, Request] = {}
    aborted: set[str] = set()
    pending_recv: set[str] = set()
    for step_no in range(1500):
        arrive_and_abort(sched, step_no, specs, aborts, requests, aborted)
        kv_out = None
        if connector is not None and faults is not None:
            kv_out = fault_output(sched, faults, pending_recv)
        res = step(sched, sample=sample_token, kv_connector_output=kv_out)
        check_invariants(sched, res.scheduled)
        if connector is not None:
            pending_recv |= {
                r.request_id
                for r in sched.waiting
                if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            }
        if step_no > max(s.arrival for s in specs) and not sched.has_requests():
            break
    else:
        raise AssertionError("trace did not finish")
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == config["num_blocks"] - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not any(sched.kv_cache_manager.req_to_blocks.values())
    assert sched.requests == {}
    return requests, aborted


class Faults:
    """Finishes pending async loads at random and, a bounded number of
    times, calls some held blocks invalid (unbounded faults could rewind a
    slow prefill forever)."""

    def __init__(self, seed: int, max_faults: int = 6) -> None:
        self.rng = random.Random(seed)
        self.left = max_faults


def fault_output(sched: Scheduler, faults: Faults, pending: set[str]) -> KVConnectorOutput:
    rng = faults.rng
    # Sorted: a set's order follows PYTHONHASHSEED, and a failing example
    # must replay the same way in another process.
    done = {r for r in sorted(pending) if rng.random() < 0.6}
    pending -= done
    invalid: set[int] = set()
    if faults.left and rng.random() < 0.3:
        faults.left -= 1
        held = [b.block_id for (bl,) in sched.kv_cache_manager.req_to_blocks.values() for b in bl]
        if held:
            invalid = set(rng.sample(held, k=min(len(held), rng.randint(1, 3))))
    return KVConnectorOutput(finished_recving=done, invalid_block_ids=invalid)


def expected_outputs(spec: Spec, max_model_len: int, rid: str) -> list[int]:
    req = make_request(rid, spec.prompt, max_tokens=spec.max_tokens)
    out: list[int] = []
    while True:
        tok = sample_token(req)
        req.append_output_token_id(tok)
        out.append(tok)
        if len(out) >= spec.min_tokens and tok == EOS and not spec.ignore_eos:
            return out
        if len(out) >= spec.max_tokens or req.num_tokens >= max_model_len:
            return out


PROPS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(traces())
def test_random_traces_keep_every_invariant(trace):
    config, specs, aborts = trace
    requests, aborted = run_trace(config, specs, aborts)
    for rid, req in requests.items():
        if rid in aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED
            continue
        spec = specs[int(rid[1:])]
        assert req.output_token_ids == expected_outputs(spec, config["max_model_len"], rid)
        stopped = req.status == RequestStatus.FINISHED_STOPPED
        assert (
            stopped
            or len(req.output_token_ids) == spec.max_tokens
            or (req.num_tokens >= config["max_model_len"])
        )


@PROPS
@given(traces(windowed=True))
def test_sliding_window_groups_keep_every_invariant(trace):
    """As above with KV cache groups whose blocks leave a window: the same
    tokens (the runner's model is not involved), every block freed in time
    and none too early."""
    config, specs, aborts = trace
    requests, aborted = run_trace(config, specs, aborts)
    for rid, req in requests.items():
        if rid not in aborted:
            spec = specs[int(rid[1:])]
            assert req.output_token_ids == expected_outputs(spec, config["max_model_len"], rid)


@PROPS
@given(traces(), st.booleans(), st.integers(0, 2**16))
def test_load_failures_never_change_outputs(trace, load_async, seed):
    config, specs, _ = trace
    rng = random.Random(seed)
    external = {f"r{i}": rng.randint(0, len(s.prompt) - 1) for i, s in enumerate(specs)}
    connector = FakeConnector(external, load_async=load_async)
    requests, _ = run_trace(config, specs, [], connector=connector, faults=Faults(seed))
    for rid, req in requests.items():
        spec = specs[int(rid[1:])]
        assert req.output_token_ids == expected_outputs(spec, config["max_model_len"], rid)
