"""Speculative decoding on the default model (issue 20): output tokens/s with
and without drafts, greedy, on a copy-heavy and a free workload, single
stream and 16 concurrent.

Engines, all alive at once and run interleaved (base, ngram, draft, base,
ngram, draft, ...): ``base`` (no speculation), ``ngram`` (prompt lookup,
``--k`` drafts at most, sent where the adaptive policy says they pay),
``fixed`` (the same, every draft sent), ``async`` (``ngram`` under
asynchronous scheduling) and ``draft`` (the default model
drafting for itself: an upper bound on acceptance; its cost is one draft
forward per draft token, so on a CPU, where a forward costs about as much
as the target's, it cannot win).

Workloads (chat-templated): ``copy``, outputs that largely copy the prompt
(repeat a passage, fix its spelling, rename a function in code, reformat
a list), ``hand``, the same kind of task around text written by other
people, read at run time (functions of the standard library, a package's
README paragraph: not shaped for the proposer), and ``free``, open
questions. Single stream: each prompt alone, one
after another; 16 concurrent: 16 prompts (the workload's, cycled) in one
``generate``. A run's figure is its output tokens / wall seconds; ratios are
taken per round against that round's base run, then the median (min-max).
Acceptance rate and mean accepted length (tokens per verifying step,
bonus included) come from the engine's own counters. The load average is
printed before and after every run: another process on one of the two
cores slows a 2-thread torch run many times over.

    .venv/bin/python benchmarks/spec_decode_bench.py [--rounds 3] [--k 4]
        [--engines base,ngram,draft] [--modes single,c16] [--workloads copy,free]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    from engine.llm import LLM

PASSAGES = [
    "The river rose slowly through the night, and by morning the lower streets of the town "
    "were under water. Volunteers filled sandbags at the church, while the mayor walked from "
    "door to door asking families to move to higher ground. By noon the rain had stopped, "
    "but the water kept rising for two more days before it finally began to fall.",
    "Our team meets every Monday at nine to plan the week. Each member lists the tasks they "
    "finished, the tasks they will start, and anything that blocks them. The notes are shared "
    "in the team folder so that anyone who missed the meeting can catch up before lunch.",
    "To make the bread, mix the flour, water, salt and yeast in a large bowl until no dry "
    "flour remains. Cover the bowl and let the dough rest for one hour. Fold it twice, shape "
    "it into a round loaf, and bake it at two hundred and thirty degrees for forty minutes.",
]
CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
"""
COPY_TASKS = [
    *(f"Repeat the following text exactly, word for word:\n\n{p}" for p in PASSAGES),
    f"Fix the spelling and return the full text: {PASSAGES[0].replace('the', 'teh')}",
    f"Repeat this code exactly:\n\n{CODE}",
    "Rewrite this list with one item per line: apples, pears, plums, grapes, lemons, "
    "cherries, peaches, melons, oranges, limes.",
]


def hand_tasks() -> list[str]:
    """Copy-heavy prompts around text written by other people, read at run
    time from the standard library and an installed package (not chosen or
    shaped for the proposer): rewrite it with one small change."""
    import fnmatch
    import inspect
    import json
    import shlex
    import statistics
    import textwrap

    def source(obj: object) -> str:
        return textwrap.dedent(inspect.getsource(obj))  # type: ignore[arg-type]

    doc = (json.__doc__ or "").strip().split("\n\n")[0]
    return [
        f"Rewrite this function, renaming the variable chunks to pieces:\n\n"
        f"{source(textwrap.TextWrapper._split)}",
        f"Rewrite this function, renaming the parameter data to values:\n\n"
        f"{source(statistics.median)}",
        f"Rewrite this function under the name shell_quote:\n\n{source(shlex.quote)}",
        f"Rewrite this function, adding a comment above its last line:\n\n"
        f"{source(fnmatch.fnmatch)}",
        f"Rewrite this paragraph, changing the word 'JSON' to 'Json':\n\n{doc}",
        f"Rewrite this paragraph with 'HTTP' in lower case:\n\n{_readme_paragraph()}",
    ]


def _readme_paragraph() -> str:
    """The first prose paragraph of requests' README (its package metadata),
    or of the textwrap module's docstring where requests is missing."""
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        body = metadata("requests").get_payload()  # type: ignore[attr-defined]
    except PackageNotFoundError:
        import textwrap

        return textwrap.__doc__ or ""
    paragraphs = [p.strip() for p in str(body).split("\n\n")]
    return next(p for p in paragraphs if p[:1].isalpha() and len(p) > 200)


FREE_TASKS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how an airplane stays in the air.",
    "What are good habits for learning a new language?",
    "Describe a busy market in the morning.",
    "Give advice to someone starting their first job.",
    "Why do leaves change color in autumn?",
]


@dataclass
class Run:
    tokens: int
    seconds: float
    drafts: int
    draft_tokens: int
    accepted: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def _engines(names: list[str], k: int, lookup: tuple[int, int]) -> dict[str, LLM]:
    from engine.config import SpeculativeConfig
    from engine.llm import LLM
    from engine.models.loader import resolve_model

    ngram = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=k,
        prompt_lookup_min=lookup[0],
        prompt_lookup_max=lookup[1],
    )
    specs = {
        "base": None,
        "ngram": ngram,
        # Every draft sent, whatever it costs (the adaptive policy off).
        "fixed": replace(ngram, adaptive=False),
        "async": ngram,
        "draft": SpeculativeConfig(
            method="draft_model", model=str(resolve_model(None)), num_speculative_tokens=k
        ),
    }
    return {
        n: LLM(
            max_model_len=2048,
            kv_cache_memory=1 << 30,
            speculative=specs[n],
            async_scheduling=n == "async",
        )
        for n in names
    }


def _run(llm: LLM, prompts: list[str], concurrent: bool) -> Run:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=160, temperature=0.0)
    stats = llm.core.scheduler.spec_stats
    before = stats.copy() if stats is not None else None
    start = time.perf_counter()
    if concurrent:
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    if stats is None or before is None:
        return Run(tokens, seconds, 0, 0, 0)
    return Run(
        tokens,
        seconds,
        stats.num_drafts - before.num_drafts,
        stats.num_draft_tokens - before.num_draft_tokens,
        stats.num_accepted_tokens - before.num_accepted_tokens,
    )


def _fmt(values: list[float], unit: str = "") -> str:
    return f"{statistics.median(values):.2f}{unit} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--engines", default="base,ngram,draft", help="of base,ngram,fixed,async,draft")
    ap.add_argument("--lookup", default="", help="ngram's prompt_lookup_min,max")
    ap.add_argument("--modes", default="single,c16")
    ap.add_argument("--workloads", default="copy,hand,free")
    args = ap.parse_args()
    names = args.engines.split(",")
    if names[0] != "base":
        raise SystemExit("--engines must start with base (the baseline)")
    print(f"load average before loading: {os.getloadavg()[0]:.2f}")
    from engine.config import SpeculativeConfig

    default = SpeculativeConfig()
    lookup = (default.prompt_lookup_min, default.prompt_lookup_max)
    if args.lookup:
        low, high = args.lookup.split(",")
        lookup = (int(low), int(high))
    print(f"ngram prompt_lookup_min,max = {lookup}")
    engines = _engines(names, args.k, lookup)
    llm0 = next(iter(engines.values()))
    tasks = {"copy": COPY_TASKS, "hand": hand_tasks(), "free": FREE_TASKS}
    cases = [(w, m) for w in args.workloads.split(",") for m in args.modes.split(",")]
    runs: dict[tuple[str, str, str], list[Run]] = {}
    for r in range(args.rounds):
        for workload, mode in cases:
            prompts = [llm0.chat_prompt([{"role": "user", "content": t}]) for t in tasks[workload]]
            if mode == "c16":
                prompts = [prompts[i % len(prompts)] for i in range(16)]
            for name, llm in engines.items():
                load = os.getloadavg()[0]
                run = _run(llm, prompts, concurrent=mode == "c16")
                runs.setdefault((workload, mode, name), []).append(run)
                print(
                    f"round {r} {workload:4s} {mode:6s} {name:5s} {run.tok_s:7.1f} tok/s "
                    f"({run.tokens} tokens in {run.seconds:.1f} s) load {load:.2f}->"
                    f"{os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    print(f"\nmedians (min-max) over {args.rounds} rounds, k={args.k}")
    for workload, mode in cases:
        base = runs[(workload, mode, "base")]
        for name in names:
            rs = runs[(workload, mode, name)]
            line = f"{workload:4s} {mode:6s} {name:5s} {_fmt([x.tok_s for x in rs], ' tok/s')}"
            if name != "base":
                ratios = [x.tok_s / b.tok_s for x, b in zip(rs, base, strict=True)]
                acc = sum(x.accepted for x in rs) / max(1, sum(x.draft_tokens for x in rs))
                length = 1 + sum(x.accepted for x in rs) / max(1, sum(x.drafts for x in rs))
                line += f"  x{_fmt(ratios)} vs base, acceptance {acc:.2f}, mean length {length:.2f}"
            print(line)


if __name__ == "__main__":
    main()
