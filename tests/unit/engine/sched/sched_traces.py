"""Random scheduler traces for the differential check against vLLM.

Shared by Tandem's side (``scheduler_diff.py``) and vLLM's
(``baselines/vllm_scheduler_diff.py``), so this module imports neither: each
side wraps its own scheduler in a ``Side`` and ``replay`` drives it.

Everything the fake model and the fake KV connector do is a function of the
trace seed, the request id and a per-request counter, never of global
state: while both schedulers decide alike they see the same events, and
after the first difference each run stays self-consistent.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

EOS = 2
# A small pool of shared prefixes, so requests get prefix-cache hits.
PREFIXES = [[1000 + 100 * i + j for j in range(96)] for i in range(3)]


@dataclass(frozen=True)
class TraceConfig:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    prefix_caching: bool
    chunked_prefill: bool
    policy: str
    long_prefill_token_threshold: int
    connector: bool
    # Both sides run their AsyncScheduler, one step in flight (replay).
    async_scheduling: bool = False


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    priority: int
    arrival_step: int
    ignore_eos: bool
    # What the fake connector offers: this many leading tokens, loaded
    # asynchronously or not; and whether it holds the blocks after the
    # request finishes (a P/D producer: freed by finished_sending).
    external_tokens: int
    load_async: bool
    delay_free: bool
    # Fixed steps until an async load / a delayed free completes (scenarios);
    # None: drawn at random.
    recv_delay: int | None = None
    send_delay: int | None = None

    @property
    def arrival_time(self) -> float:
        # Distinct per request, so priority ties never fall to object order.
        return self.arrival_step + int(self.request_id[1:]) / 1000


@dataclass(frozen=True)
class Trace:
    seed: int
    config: TraceConfig
    requests: list[RequestSpec]
    load_failure_rate: float = 0.15


def as_async(trace: Trace) -> Trace:
    """The trace for asynchronous scheduling: the same requests without a
    KV connector (the pipelined replay drives no connector)."""
    config = replace(trace.config, connector=False, async_scheduling=True)
    return replace(trace, config=config)


def make_trace(seed: int) -> Trace:
    rng = random.Random(seed)
    block_size = rng.choice([8, 16])
    max_model_len = rng.randint(24, 96)
    chunked = rng.random() < 0.7
    max_num_seqs = rng.randint(1, 8)
    low = max(8, max_num_seqs) if chunked else max_model_len  # unchunked: a prompt fits
    budget = rng.randint(low, 160 if chunked else 200)
    min_blocks = -(-max_model_len // block_size) + 1
    connector = rng.random() < 0.5
    config = TraceConfig(
        block_size=block_size,
        # Small pools, to force preemption and blocked queue heads.
        num_blocks=rng.randint(min_blocks, min_blocks + 24),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        prefix_caching=rng.random() < 0.7,
        chunked_prefill=chunked,
        policy=rng.choice(["fcfs", "priority"]),
        long_prefill_token_threshold=rng.choice([0, 0, 0, 8, 24]),
        connector=connector,
    )
    requests = [_make_request(rng, config, i) for i in range(rng.randint(1, 12))]
    return Trace(seed, config, requests)


def _make_request(rng: random.Random, config: TraceConfig, index: int) -> RequestSpec:
    max_len = config.max_model_len
    prompt_len = rng.randint(1, max_len)
    prefix: list[int] = []
    if rng.random() < 0.5:
        prefix = rng.choice(PREFIXES)[: rng.randint(0, prompt_len)]
    prompt = prefix + [rng.randrange(3, 999) for _ in range(prompt_len - len(prefix))]
    max_tokens = rng.randint(1, 48)
    external = 0
    if config.connector and prompt_len > 1 and rng.random() < 0.6:
        external = rng.randint(1, prompt_len - 1)
        if rng.random() < 0.5:  # real connectors mostly hit whole blocks
            external = external // config.block_size * config.block_size
    return RequestSpec(
        request_id=f"r{index}",
        prompt=prompt,
        max_tokens=max_tokens,
        min_tokens=rng.randint(1, min(6, max_tokens)) if rng.random() < 0.2 else 0,
        priority=rng.randint(0, 3),
        arrival_step=rng.randint(0, 40),
        ignore_eos=rng.random() < 0.3,
        external_tokens=external,
        load_async=config.connector and rng.random() < 0.6,
        delay_free=config.connector and rng.random() < 0.4,
    )


def event_rng(seed: int, request_id: str, kind: str, counter: int) -> random.Random:
    # String seeds hash with SHA-512: the same in every interpreter.
    return random.Random(f"{seed}/{request_id}/{kind}/{counter}")


def sample_token(seed: int, request_id: str, position: int) -> int:
    """The fake model: deterministic per (request, position), EOS ~1 in 9."""
    rng = event_rng(seed, request_id, "token", position)
    return EOS if rng.random() < 0.11 else rng.randrange(3, 50_000)


@dataclass
class Load:
    """A load the connector was asked for: which blocks it writes."""

    request_id: str
    block_ids: list[int]
    num_local_tokens: int
    num_external_tokens: int
    is_async: bool


@dataclass
class ConnectorScript:
    """The fake connector's decisions, wrapped by each side's connector
    class (whose method signatures differ a little)."""

    trace: Trace
    specs: dict[str, RequestSpec] = field(init=False)
    loads: list[Load] = field(default_factory=list)
    delayed_frees: list[str] = field(default_factory=list)
    _async: dict[str, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.specs = {s.request_id: s for s in self.trace.requests}

    def matched(self, request_id: str, num_local_tokens: int) -> tuple[int, bool]:
        spec = self.specs[request_id]
        ext = max(0, spec.external_tokens - num_local_tokens)
        load_async = spec.load_async and ext > 0
        self._async[request_id] = load_async
        return ext, load_async

    def allocated(self, request_id: str, block_ids: list[int], num_external: int) -> None:
        if num_external <= 0:
            return
        num_local = self.specs[request_id].external_tokens - num_external
        self.loads.append(
            Load(request_id, block_ids, num_local, num_external, self._async[request_id])
        )

    def finished(self, request_id: str, block_ids: list[int]) -> bool:
        """Whether the blocks are held (freed later by finished_sending)."""
        delay = self.specs[request_id].delay_free and bool(block_ids)
        if delay:
            self.delayed_frees.append(request_id)
        return delay


class Side(Protocol):
    """One scheduler under test, as ``replay`` drives it."""

    script: ConnectorScript

    def add(self, spec: RequestSpec) -> None: ...

    def schedule(self) -> tuple[dict[str, int], list[str]]:
        """Run schedule(); (num_scheduled_tokens, preempted ids)."""
        ...

    def computed_and_total(self, request_id: str) -> tuple[int, int]:
        """(num_computed_tokens, num_tokens) of a live request."""
        ...

    def num_output_tokens(self, request_id: str) -> int: ...

    def num_output_placeholders(self, request_id: str) -> int: ...

    def update(
        self,
        sampled: dict[str, list[int]],
        finished_sending: set[str],
        finished_recving: set[str],
        invalid_block_ids: set[int],
    ) -> dict[str, str]:
        """Run update_from_output(); finish reasons by request id."""
        ...

    def waiting_for_remote(self) -> list[str]:
        """Requests parked in WAITING_FOR_REMOTE_KVS."""
        ...

    def has_requests(self) -> bool: ...

    def num_free_blocks(self) -> int: ...

    def notes(self) -> list[str]:
        """Side-specific events of the last step (e.g. Tandem's breaker)."""
        ...


@dataclass
class StepRecord:
    """One step's decisions: what is compared between the two sides."""

    scheduled: list[tuple[str, int, int]]  # (request id, tokens, computed before)
    preempted: list[str]
    finished: list[tuple[str, str]]
    free_blocks: int
    notes: list[str]


@dataclass
class TraceResult:
    seed: int
    steps: list[StepRecord]
    # "done", "deadlock" (idle, nothing pending), "livelock" (step limit)
    # or "crash: <error>".
    outcome: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TraceResult:
        steps = [
            StepRecord(
                [(r, n, c) for r, n, c in s["scheduled"]],
                list(s["preempted"]),
                [(r, f) for r, f in s["finished"]],
                s["free_blocks"],
                list(s["notes"]),
            )
            for s in data["steps"]
        ]
        return cls(data["seed"], steps, data["outcome"])


MAX_STEPS = 1500
IDLE_STEPS = 40  # idle with nothing pending this long: a deadlock


def replay(trace: Trace, side: Side, max_steps: int = MAX_STEPS) -> TraceResult:
    world = _PipelinedWorld(trace, side) if trace.config.async_scheduling else _World(trace, side)
    try:
        outcome = world.run(max_steps)
    except Exception as exc:  # the harness reports a crash, it does not stop
        outcome = f"crash: {type(exc).__name__}: {exc}"
    return TraceResult(trace.seed, world.steps, outcome)


@dataclass
class _World:
    """The fake model runner and worker-side connector around one side."""

    trace: Trace
    side: Side
    steps: list[StepRecord] = field(default_factory=list)
    pending_recv: dict[str, tuple[int, Load]] = field(default_factory=dict)
    pending_send: dict[str, int] = field(default_factory=dict)
    counters: dict[tuple[str, str], int] = field(default_factory=dict)

    def rng(self, request_id: str, kind: str) -> random.Random:
        key = (request_id, kind)
        self.counters[key] = n = self.counters.get(key, 0) + 1
        return event_rng(self.trace.seed, request_id, kind, n)

    def run(self, max_steps: int) -> str:
        last_arrival = max(s.arrival_step for s in self.trace.requests)
        idle = 0
        for step_no in range(max_steps):
            for spec in self.trace.requests:
                if spec.arrival_step == step_no:
                    self.side.add(spec)
            scheduled = self.step(step_no)
            if step_no >= last_arrival and self.drained():
                return "done"
            pending = self.pending_recv or self.pending_send
            idle = 0 if scheduled or pending or step_no < last_arrival else idle + 1
            if idle >= IDLE_STEPS:
                return "deadlock"
        return "livelock"

    def drained(self) -> bool:
        return not self.side.has_requests()

    def step(self, step_no: int) -> bool:
        side = self.side
        computed: dict[str, int] = {}
        num_scheduled, preempted = side.schedule()
        invalid: set[int] = set()
        for load in side.script.loads:
            if load.is_async:
                delay = self.delay(load.request_id, "recv")
                self.pending_recv[load.request_id] = (step_no + delay, load)
            else:
                invalid |= self.failed_blocks(load)
        side.script.loads.clear()
        recv = {r for r, (due, _) in self.pending_recv.items() if due <= step_no}
        for rid in sorted(recv):
            invalid |= self.failed_blocks(self.pending_recv.pop(rid)[1])
        send = {r for r, due in self.pending_send.items() if due <= step_no}
        for rid in send:
            del self.pending_send[rid]
        sampled: dict[str, list[int]] = {}
        for rid, n in num_scheduled.items():
            done, total = side.computed_and_total(rid)
            computed[rid] = done - n
            if done >= total:
                position = side.num_output_tokens(rid)
                sampled[rid] = [sample_token(self.trace.seed, rid, position)]
            else:
                sampled[rid] = []
        finished = side.update(sampled, send, recv, invalid)
        for rid in side.script.delayed_frees:
            self.pending_send[rid] = step_no + 1 + self.delay(rid, "send")
        side.script.delayed_frees.clear()
        self.record(num_scheduled, computed, preempted, finished)
        return bool(num_scheduled)

    def record(
        self,
        num_scheduled: dict[str, int],
        computed: dict[str, int],
        preempted: list[str],
        finished: dict[str, str],
    ) -> None:
        self.steps.append(
            StepRecord(
                sorted((r, n, computed[r]) for r, n in num_scheduled.items()),
                sorted(preempted),
                sorted(finished.items()),
                self.side.num_free_blocks(),
                self.side.notes(),
            )
        )

    def delay(self, request_id: str, kind: str) -> int:
        spec = self.side.script.specs[request_id]
        fixed = spec.recv_delay if kind == "recv" else spec.send_delay
        return self.rng(request_id, kind).randint(0, 4) if fixed is None else fixed

    def failed_blocks(self, load: Load) -> set[int]:
        """Now and then one block of a load fails (invalid_block_ids)."""
        rng = self.rng(load.request_id, "fail")
        if rng.random() >= self.trace.load_failure_rate:
            return set()
        bs = self.trace.config.block_size
        first = load.num_local_tokens // bs
        end = min(len(load.block_ids), -(-(load.num_local_tokens + load.num_external_tokens) // bs))
        if end <= first:
            return set()
        return {load.block_ids[rng.randrange(first, end)]}


@dataclass
class _InFlight:
    scheduled: dict[str, int]
    sampled: dict[str, list[int]]


@dataclass
class _PipelinedWorld(_World):
    """Asynchronous scheduling: each step schedules the next before the
    previous one's tokens are applied, as Tandem's StepPipeline and vLLM's
    batch queue of two do. Which requests sample (and the index of their
    token) is known at schedule time from the placeholders."""

    in_flight: _InFlight | None = None

    def drained(self) -> bool:
        return not self.side.has_requests() and self.in_flight is None

    def step(self, step_no: int) -> bool:
        side = self.side
        previous, self.in_flight = self.in_flight, None
        num_scheduled: dict[str, int] = {}
        preempted: list[str] = []
        computed: dict[str, int] = {}
        if side.has_requests():
            num_scheduled, preempted = side.schedule()
            sampled: dict[str, list[int]] = {}
            for rid, n in num_scheduled.items():
                done, total = side.computed_and_total(rid)
                computed[rid] = done - n
                placeholders = side.num_output_placeholders(rid)
                sampled[rid] = []
                if placeholders and done == total + placeholders - 1:
                    index = side.num_output_tokens(rid) + placeholders - 1
                    sampled[rid] = [sample_token(self.trace.seed, rid, index)]
            self.in_flight = _InFlight(num_scheduled, sampled)
        finished = side.update(previous.sampled, set(), set(), set()) if previous else {}
        self.record(num_scheduled, computed, preempted, finished)
        return bool(num_scheduled)


def run_traces(
    seeds: list[int], make_side: Callable[[Trace], Side], emit: Callable[[TraceResult], None]
) -> None:
    for seed in seeds:
        trace = make_trace(seed)
        emit(replay(trace, make_side(trace)))


def _scenario_request(
    index: int, prompt: int, max_tokens: int, *, external: int = 0, **kw: Any
) -> RequestSpec:
    """Distinct tokens per request (no accidental prefix hits), no EOS."""
    fields: dict[str, Any] = {
        "priority": 0,
        "arrival_step": 0,
        "load_async": external > 0,
        "delay_free": False,
        "recv_delay": 1,
        **kw,
    }
    return RequestSpec(
        request_id=f"r{index}",
        prompt=list(range(1000 * (index + 1), 1000 * (index + 1) + prompt)),
        max_tokens=max_tokens,
        min_tokens=0,
        ignore_eos=True,
        external_tokens=external,
        **fields,
    )


def _scenario_config(usable_blocks: int, **kw: Any) -> TraceConfig:
    fields: dict[str, Any] = {
        "block_size": 16,
        "num_blocks": usable_blocks + 1,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "max_model_len": 96,
        "prefix_caching": True,
        "chunked_prefill": True,
        "policy": "fcfs",
        "long_prefill_token_threshold": 0,
        "connector": True,
        **kw,
    }
    return TraceConfig(**fields)


# Hand-made traces of the deadlock breaker's cases (scheduler_diff.py
# --scenarios; tests/unit/engine/sched/test_scheduler_breaker.py asserts the
# same decisions). Block size 16; loads finish one step after they start.
SCENARIOS: dict[str, Trace] = {
    # The last running request (r1) would preempt itself while r2's finished
    # load is parked, but r0 finishes in that same step: vLLM preempts r1
    # and resumes it (its prefix cached) beside r2 two steps later.
    "finish_in_same_step": Trace(
        -1,
        _scenario_config(7),
        [
            _scenario_request(0, 30, 3),
            _scenario_request(1, 31, 4),
            _scenario_request(2, 60, 2, external=48),
        ],
        load_failure_rate=0.0,
    ),
    # Nothing runs and the head (r1, its load finished) does not fit while
    # r2's finished load is parked, but r0's held blocks come back by
    # finished_sending in that same step: vLLM waits one step and admits
    # both.
    "free_in_same_step": Trace(
        -2,
        _scenario_config(8, prefix_caching=False),
        [
            _scenario_request(0, 48, 1, delay_free=True, send_delay=1),
            _scenario_request(1, 56, 2, external=32),
            _scenario_request(2, 40, 2, external=32),
        ],
        load_failure_rate=0.0,
    ),
    # As above with no held blocks to wait for: a deadlock vLLM stays in.
    # r3's parked load is released (the least urgent), which is enough for
    # the head r1; r2 keeps its load.
    "deadlock": Trace(
        -3,
        _scenario_config(7, prefix_caching=False),
        [
            _scenario_request(1, 56, 2, external=32),
            _scenario_request(2, 40, 2, external=32),
            _scenario_request(3, 40, 2, external=32),
        ],
        load_failure_rate=0.0,
    ),
    # r1 runs alone in 16-token chunks (no prefix caching) and hits the
    # blocks r0's finished load parks: it preempts itself and starts over,
    # forever in vLLM. Tandem does so once, then releases r0's blocks.
    "livelock": Trace(
        -4,
        _scenario_config(6, prefix_caching=False, max_num_batched_tokens=16),
        [
            _scenario_request(0, 64, 2, external=32),
            _scenario_request(1, 80, 2),
        ],
        load_failure_rate=0.0,
    ),
}
