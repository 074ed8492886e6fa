"""The n-gram proposer's cost per step (issue 20, in progress).

``NgramProposer.propose`` (numpy, one pass per n over the whole batch)
against the plain per-request Python loop (the test's reference), on the
same histories, alternating (vectorised, loop, ...): medians (min-max) of
the per-call time over `--rounds` rounds. Histories of `--length` tokens:
"copy" histories end with a 4-token n-gram seen earlier (a hit at the
longest n), "free" ones are random ids over the model's 49152-token
vocabulary (no hit: every n is scanned, the worst case).

    .venv/bin/python benchmarks/ngram_proposer_bench.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from engine.spec_decode.ngram import NgramProposer  # noqa: E402
from tests.unit.engine.spec_decode.test_ngram import reference  # noqa: E402

K, MIN_N, MAX_N = 4, 1, 4


def _histories(batch: int, length: int, copy: bool, rng: random.Random) -> list[list[int]]:
    out = []
    for _ in range(batch):
        h = [rng.randrange(49152) for _ in range(length)]
        if copy:
            at = rng.randrange(length // 2)
            h[-MAX_N:] = h[at : at + MAX_N]
        out.append(h)
    return out


def _loop(histories: list[list[int]]) -> list[list[int]]:
    return [reference(h, K, MIN_N, MAX_N) for h in histories]


def _time(fn: Callable[[], object], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--length", type=int, default=1024, help="history tokens (default: 1024)")
    args = p.parse_args()
    rng = random.Random(0)
    proposer = NgramProposer(K, MIN_N, MAX_N)
    print(f"load average before: {os.getloadavg()[0]:.2f}; k={K}, n in [{MIN_N}, {MAX_N}]")
    for kind in ("copy", "free"):
        for batch in (1, 16, 64):
            hist = _histories(batch, args.length, kind == "copy", rng)
            tokens = np.array(hist, np.int64)
            lengths = np.full(batch, args.length, np.int64)
            assert proposer.propose(tokens, lengths) == _loop(hist)
            vec, loop = [], []
            for _ in range(args.rounds):
                vec.append(_time(partial(proposer.propose, tokens, lengths), 5))
                loop.append(_time(partial(_loop, hist), 1))
            mv, ml = statistics.median(vec), statistics.median(loop)
            print(
                f"{kind:<4} batch {batch:>2}: vectorised {mv:8.3f} ms "
                f"({min(vec):.3f}-{max(vec):.3f}), loop {ml:8.3f} ms "
                f"({min(loop):.3f}-{max(loop):.3f}), loop/vectorised {ml / mv:6.1f}",
                flush=True,
            )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
