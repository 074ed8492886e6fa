"""The scheduler's decisions against vLLM 0.12.0's, on every run.

``data/vllm_0.12.0_traces.jsonl.gz`` holds vLLM's own per-step decisions on
404 traces of ``sched_traces.py`` (seeds 0-299 synchronously, with and
without a KV connector; seeds 0-99 with asynchronous scheduling; the four
breaker scenarios), recorded once by ``benchmarks/scheduler_diff.py
--record`` with the verdict Tandem got then. Each trace is replayed through
Tandem's scheduler here and classified against vLLM's decisions as the
harness does: a trace that was identical must still be identical step by
step, and one that differed must differ in the same documented way
(``max_model_len``, ``min_tokens``, an asynchronous load counting only what
it delivered, the deadlock breaker) at the same step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from tests.unit.engine.sched.tandem_replay import Replayed, replay_recorded

DATA = Path(__file__).parent / "data" / "vllm_0.12.0_traces.jsonl.gz"
ROOT = Path(__file__).resolve().parents[4]
# The ways Tandem's decisions may differ from vLLM's (docs/scheduler.md).
DEPARTURES = {"max_model_len", "min_tokens", "async load"}


def replayed() -> list[Replayed]:
    if os.environ.get("PYTHONHASHSEED") == "0":
        return replay_recorded(DATA)
    # Several frees in one step go in set order, which decides which blocks
    # are reused: the recording ran with PYTHONHASHSEED=0, so does this.
    proc = subprocess.run(
        [sys.executable, "-m", "tests.unit.engine.sched.tandem_replay", str(DATA)],
        cwd=ROOT,
        env={**os.environ, "PYTHONHASHSEED": "0"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [Replayed(**r) for r in json.loads(proc.stdout)]


def test_tandem_decides_as_vllm_did_on_the_recorded_traces():
    results = replayed()
    recorded = Counter(r.recorded or "identical" for r in results)
    assert len(results) == 404
    # The data: every difference was a documented departure when recorded.
    assert all(
        r.recorded is None or r.recorded in DEPARTURES or r.recorded.startswith("breaker")
        for r in results
    ), recorded
    changed = [r for r in results if (r.verdict, r.step) != (r.recorded, r.recorded_step)]
    identical = sum(r.verdict is None for r in results)
    summary = (
        f"{identical} of {len(results)} traces identical to vLLM 0.12.0 "
        f"(recorded: {dict(recorded)})"
    )
    lines = [
        f"  {r.mode} seed {r.seed}: recorded {r.recorded or 'identical'} "
        f"(step {r.recorded_step}), now {r.verdict or 'identical'} (step {r.step}) {r.detail}"
        for r in changed[:10]
    ]
    assert not changed, "\n".join(
        [f"{len(changed)} traces decided differently than when recorded; {summary}", *lines]
    )
    assert identical == recorded["identical"], summary
