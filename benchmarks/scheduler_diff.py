"""Differential check: Tandem's scheduler against vLLM 0.12.0's, step by step.

Random traces (``tests/unit/engine/sched/sched_traces.py``: prompt lengths, max_tokens, priorities,
arrival steps, shared prefixes, small block pools that force preemption,
and in half of them a fake KV connector with sync and async loads, load
failures and delayed frees) are replayed through both schedulers with the
same config. Per step the scheduled requests and token counts, preemptions,
finishes and free-block counts are compared. vLLM runs in its own
interpreter (``baselines/vllm_scheduler_diff.py``); Tandem never imports it.

    python benchmarks/scheduler_diff.py --vllm-python /work/vllmenv/bin/python \
        --traces 2450
    python benchmarks/scheduler_diff.py --dump before.jsonl   # Tandem alone

Each trace that differs is classified by its first differing step
(``tandem_replay.classify``): Tandem's documented max_model_len and
min_tokens departures, an asynchronous load counting only the tokens it
delivered, Tandem's deadlock breaker (then by whether vLLM completed that
trace), or unexplained. Run by hand; ``--record`` writes vLLM's decisions
on a fixed set of traces for tests/unit/engine/sched/test_vllm_traces.py,
which replays them on every run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.unit.engine.sched.sched_traces import (  # noqa: E402
    SCENARIOS,
    Trace,
    TraceResult,
    as_async,
    make_trace,
)
from tests.unit.engine.sched.tandem_replay import (  # noqa: E402
    classify,
    first_difference,
    record,
    run_tandem,
)


def start_vllm(
    python: str, seeds: list[int], scenarios: bool, async_scheduling: bool
) -> subprocess.Popen[str]:
    script = HERE / "baselines" / "vllm_scheduler_diff.py"
    which = ["--scenarios"] if scenarios else ["--first-seed", str(seeds[0])]
    which += ["--async-scheduling"] if async_scheduling else []
    return subprocess.Popen(
        [python, str(script), *which, "--traces", str(len(seeds))],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONHASHSEED": "0"},
    )


def vllm_results(proc: subprocess.Popen[str]) -> dict[int, TraceResult]:
    vllm_out, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"the vLLM side failed with exit code {proc.returncode}")
    results = (TraceResult.from_json(json.loads(line)) for line in vllm_out.splitlines())
    return {r.seed: r for r in results}


def record_traces(python: str, path: Path, seeds: list[int], num_async: int) -> None:
    """vLLM's decisions on the seeds (synchronous), the first ``num_async``
    of them with asynchronous scheduling and the scenarios, each with the
    verdict of Tandem's run now: the data test_vllm_traces.py replays."""
    runs = [
        ("sync", [make_trace(s) for s in seeds], False, False),
        ("async", [as_async(make_trace(s)) for s in seeds[:num_async]], False, True),
        ("scenario", list(SCENARIOS.values()), True, False),
    ]
    lines = []
    kinds: Counter[str] = Counter()
    for mode, traces, scenarios, async_scheduling in runs:
        trace_seeds = [t.seed for t in traces]
        proc = start_vllm(python, trace_seeds, scenarios, async_scheduling)
        tandem = run_tandem(traces)
        vllm = vllm_results(proc)
        for trace in traces:
            rec = record(mode, trace, tandem[trace.seed], vllm[trace.seed])
            kinds[f"{mode}: {rec['verdict'] or 'identical'}"] += 1
            lines.append(json.dumps(rec, separators=(",", ":")) + "\n")
    # mtime 0 and no file name in the header: the same decisions, the same bytes.
    with path.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", filename="", mtime=0) as f:
        f.write("".join(lines).encode())
    print(f"{len(lines)} traces to {path} ({path.stat().st_size} bytes)")
    for kind, count in sorted(kinds.items()):
        print(f"  {count:5d}  {kind}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", help="interpreter with vllm==0.12.0 (else Tandem only)")
    parser.add_argument("--dump", type=Path, help="write Tandem's step records here (JSON lines)")
    parser.add_argument("--traces", type=int, default=2450)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=5, help="differences to print per kind")
    parser.add_argument("--show-kind", default="other", help="which kind (a prefix) to print")
    parser.add_argument("--explain", type=int, help="one trace: print both sides step by step")
    parser.add_argument(
        "--scenarios", action="store_true", help="the hand-made traces (sched_traces.SCENARIOS)"
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="both sides' AsyncScheduler, one step in flight (traces without a connector)",
    )
    parser.add_argument(
        "--record",
        type=Path,
        help="write vLLM's decisions and the verdicts (gzip JSON lines) for test_vllm_traces.py",
    )
    parser.add_argument(
        "--async-traces", type=int, default=100, help="--record: seeds also run asynchronously"
    )
    args = parser.parse_args()
    if os.environ.get("PYTHONHASHSEED") != "0":
        # Several frees in one step go in set order (as in vLLM), which
        # decides block reuse: both sides need the same string hashing.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    seeds = list(range(args.first_seed, args.first_seed + args.traces))
    if args.record is not None:
        if not args.vllm_python:
            raise SystemExit("--record needs --vllm-python")
        record_traces(args.vllm_python, args.record, seeds, args.async_traces)
        return
    if args.explain is not None:
        seeds = [args.explain]
    traces = list(SCENARIOS.values()) if args.scenarios else [make_trace(s) for s in seeds]
    if args.async_scheduling:
        traces = [as_async(t) for t in traces]
    seeds = [trace.seed for trace in traces]
    t0 = time.monotonic()
    proc = (
        start_vllm(args.vllm_python, seeds, args.scenarios, args.async_scheduling)
        if args.vllm_python
        else None
    )
    tandem = run_tandem(traces)
    if args.dump is not None:
        # Before/after a refactor of Tandem alone: the dumps must be equal.
        with args.dump.open("w") as f:
            f.writelines(json.dumps(tandem[seed].to_json()) + "\n" for seed in seeds)
    if proc is None:
        outcomes = Counter(r.outcome.split(":")[0] for r in tandem.values())
        print(f"{len(seeds)} traces through Tandem: {dict(outcomes)}")
        return
    vllm = vllm_results(proc)
    if args.explain is not None or args.scenarios:
        for name, trace in zip(SCENARIOS if args.scenarios else ["trace"], traces, strict=False):
            print(f"--- {name}")
            explain(trace, tandem[trace.seed], vllm[trace.seed])
        return
    report({t.seed: t for t in traces}, tandem, vllm, args.show, args.show_kind)
    print(f"({time.monotonic() - t0:.0f} s)")


def explain(trace: Trace, tandem: TraceResult, vllm: TraceResult) -> None:
    print(trace.config)
    for spec in trace.requests:
        print(
            f"  {spec.request_id}: prompt {len(spec.prompt)} max_tokens {spec.max_tokens} "
            f"min_tokens {spec.min_tokens} priority {spec.priority} arrives {spec.arrival_step} "
            f"external {spec.external_tokens} async {spec.load_async} "
            f"delay_free {spec.delay_free}"
        )
    print(f"outcomes: tandem {tandem.outcome}, vllm {vllm.outcome}")
    num_steps = max(len(tandem.steps), len(vllm.steps))
    differ = first_difference(tandem.steps, vllm.steps)
    end = num_steps if differ is None else min(num_steps, differ + 6)
    for i in range(end):
        t = tandem.steps[i] if i < len(tandem.steps) else None
        v = vllm.steps[i] if i < len(vllm.steps) else None
        print(f"{i:4d} T {t}")
        if v != t or (t is not None and t.notes):
            print(f"     V {v}")
    if end < num_steps:
        print(f"     ... ({num_steps} steps)")


def report(
    traces: dict[int, Trace],
    tandem: dict[int, TraceResult],
    vllm: dict[int, TraceResult],
    show: int,
    show_kind: str,
) -> None:
    kinds: Counter[str] = Counter()
    shown = 0
    num_steps = num_connector = 0
    for seed, trace in traces.items():
        num_steps += len(vllm[seed].steps)
        num_connector += trace.config.connector
        verdict = classify(trace, tandem[seed], vllm[seed])
        kinds["identical" if verdict is None else verdict.kind] += 1
        if verdict is not None and verdict.kind.startswith(show_kind) and shown < show:
            shown += 1
            print(f"seed {seed}: differs at step {verdict.step}: {verdict.detail}")
    outcomes = Counter(r.outcome.split(":")[0] for r in tandem.values())
    print(
        f"{len(traces)} traces ({num_steps} vLLM steps; {num_connector} with a KV connector); "
        f"Tandem outcomes: {dict(outcomes)}"
    )
    for kind, count in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {count:5d}  {kind}")


if __name__ == "__main__":
    main()
