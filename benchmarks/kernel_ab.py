"""The compiled attention kernels of an earlier commit against this tree's,
interleaved (A, B, A, B).

A kernel change is timed against the kernels it replaces, built from
`--before`'s sources (a git worktree in /tmp; each build in its own worker
process, idle while the other times: two builds' pybind11 types collide in
one process), on the shapes of
cpu_attention_bench.py: the default model's heads, 30 layers,

* decode: 64 sequences (contexts 96-544) over serving-size caches (2 GiB
  over 30 layers, blocks scattered, 2 MiB pages), each module's
  `decode_attention` called directly;
* prefill: the 64 prompts of 32-512 tokens, fresh, each module's
  `prefill_attention` (its default arithmetic for the cache).

Reported per cache dtype: milliseconds (medians, min/max) and the
before / after ratio per round. The load average is printed before and
after. Nothing is asserted.

    .venv/bin/python benchmarks/kernel_ab.py --before 2f8a97d --cache-dtypes bfloat16,int8
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402
from cpu_attention_bench import DIM, HEADS, KV_HEADS, LAYERS, _on_huge_pages, paged_batch  # noqa: E402

from kernels import cpu_kernels  # noqa: E402


def kernels_at(rev: str) -> ModuleType:
    """The compiled module built from `rev`'s kernels/ (a worktree in /tmp)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], capture_output=True, text=True, check=True, cwd=HERE
    ).stdout.strip()
    tree = Path(f"/tmp/tandem-kernels-{sha}")
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], check=True, cwd=HERE)
    path = tree / "kernels" / "cpu_kernels.py"
    spec = importlib.util.spec_from_file_location(f"cpu_kernels_{sha}", path)
    assert spec is not None and spec.loader is not None
    source = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(source)
    module = source.load()
    if module is None:
        raise SystemExit(f"{rev}'s kernels did not build")
    return module  # type: ignore[no-any-return]


def decode_run(module: ModuleType, dtype: torch.dtype) -> Callable[[], float]:
    rng = random.Random(1)
    lens = [rng.randint(96, 544) for _ in range(64)]
    query, caches, meta = paged_batch([1] * 64, lens, dtype, LAYERS, 2 * 2**30 // LAYERS)
    caches = [_on_huge_pages(c) for c in caches]
    out = torch.empty_like(query)

    def run() -> float:
        start = time.perf_counter()
        for cache in caches:
            module.decode_attention(out, query, cache, meta.block_table, meta.seq_lens, DIM**-0.5)
        return time.perf_counter() - start

    return run


def prefill_run(module: ModuleType, dtype: torch.dtype) -> Callable[[], float]:
    rng = random.Random(0)
    lens = [rng.randint(32, 512) for _ in range(64)]
    query, caches, meta = paged_batch(lens, lens, dtype, 1)
    starts = meta.query_start_loc[:-1].contiguous()
    q_lens = torch.tensor(lens, dtype=torch.int32)
    out = torch.empty_like(query)

    def run() -> float:
        start = time.perf_counter()
        for _ in range(LAYERS):
            module.prefill_attention(
                out, query, caches[0], meta.block_table, meta.seq_lens, starts, q_lens,
                DIM**-0.5,
            )  # fmt: skip
        return time.perf_counter() - start

    return run


def worker(rev: str, threads: int) -> None:
    """Serves timings of `rev`'s kernels ("HEAD": this tree's) over stdin:
    a line "decode bfloat16" sets up (once) and times one round (best of 3),
    printing the seconds. Two builds cannot share a process (their pybind11
    types collide), so each runs in its own, idle while the other times."""
    torch.set_num_threads(threads)
    module = cpu_kernels.load() if rev == "HEAD" else kernels_at(rev)
    if module is None:
        raise SystemExit(f"{rev}'s kernels did not build")
    runs: dict[str, Callable[[], float]] = {}
    with torch.inference_mode():
        for line in sys.stdin:
            what, dtype = line.split()
            key = f"{what} {dtype}"
            if key not in runs:
                make = decode_run if what == "decode" else prefill_run
                runs[key] = make(module, getattr(torch, dtype))
                runs[key]()  # warm
            print(min(runs[key]() for _ in range(3)), flush=True)


def report(what: str, times: dict[str, list[float]]) -> None:
    print(what)
    for name, values in times.items():
        print(
            f"  {name:<7} {statistics.median(values) * 1e3:7.1f} ms "
            f"(min {min(values) * 1e3:.1f}, max {max(values) * 1e3:.1f})"
        )
    before, after = times.values()
    ratios = [b / a for b, a in zip(before, after, strict=True)]
    print(
        f"  before / after per round: {statistics.median(ratios):.2f}x "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the commit whose kernels to time against")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dtypes", default="bfloat16,int8")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.threads)
        return
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--before",
                args.before,
                "--worker",
                rev,
                "--threads",
                str(args.threads),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, rev in (("before", args.before), ("after", "HEAD"))
    }

    def timed(name: str, what: str) -> float:
        proc = procs[name]
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(what + "\n")
        proc.stdin.flush()
        return float(proc.stdout.readline())

    print(f"heads {HEADS}/{KV_HEADS}, head dim {DIM}; load before: {os.getloadavg()}", flush=True)
    for dtype in args.cache_dtypes.split(","):
        for what in ("decode", "prefill"):
            job = f"{what} {dtype}"
            times: dict[str, list[float]] = {name: [] for name in procs}
            for name in procs:  # set-up and warm-up, untimed
                timed(name, job)
            for _ in range(args.rounds):
                for name in procs:
                    times[name].append(timed(name, job))
            report(f"{what}, {dtype} cache ({LAYERS} layers)", times)
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
