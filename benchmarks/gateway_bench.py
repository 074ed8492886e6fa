"""Serving through smg (OpenAI HTTP) against tandem.v1 direct (gRPC), same load.

One `tandem serve` pod and `tandem gateway` (smg) in front of it.

First, `--ttft-pairs` pairs of single requests (one per path, ABBA order,
connections opened once, fresh prompts: no prefix-cache hit) for each of
`--ttft-input-len`: the TTFT smg adds at concurrency 1, as the median and
mean of the per-pair differences (single requests vary by far more than
the path adds, so rounds' medians cannot show it).

Then rounds: each sends the same closed-loop load (`--concurrency` streams
at a time, `--requests` in all) of random prompts in vllm bench serve's
"random" dataset style: `--input-len` random whole words (smg takes text as
a completion prompt, not ids; both paths send the same text),
`--output-len` tokens out, EOS ignored, greedy, fresh prompts each run.
The paths alternate (direct, smg, direct, smg, ...) with the same client
structure (one asyncio loop, a semaphore): direct is tandem.v1 Generate
over grpc.aio; smg is streamed `/v1/completions` read as `vllm bench
serve` reads it (raw SSE lines, json.loads). Per round: output tokens/s,
median and p99 time to first token (TTFT) and inter-token latency (ITL,
each gap between streamed chunks divided by the tokens it carried; an
OpenAI chunk counts as one token and the usage's remainder goes to the
last, since smg's chunks carry text, not token counts), the pod's median
step time, and the CPU seconds per 1000 output tokens of the pod, smg and
this client (they share the 2 cores). Reports medians (min-max) over
rounds, smg/direct ratios, and the 1-minute load average before and after
(a foreign process on one of the 2 cores spoils every figure: run it on a
quiet machine).

    .venv/bin/python benchmarks/gateway_bench.py --concurrency 1,64 --rounds 3

`--lora` runs every request under a LoRA adapter (tests/lora_adapters.py's
"qv8", rank 8 on q/v, saved by peft): direct names it in tandem.v1's
`lora_name`; smg reaches it as its own model, the pod serving it on its
own port (`--lora-port`) that smg has as a second worker (issue 43).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx2  # noqa: E402
import openai  # noqa: E402

from service.bench import free_port  # noqa: E402
from service.client import TandemClient, make_request, wait_serving  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Timing:
    """One request: when it started, when each chunk came, tokens per chunk."""

    start: float
    chunks: list[tuple[float, int]] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.start

    def itls(self) -> list[float]:
        gaps = []
        for (t0, _), (t1, n) in zip(self.chunks, self.chunks[1:], strict=False):
            gaps += [(t1 - t0) / n] * n
        return gaps

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)


@dataclass
class Round:
    path: str
    concurrency: int
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    # The pod's own median step time over its last 128 steps, read right
    # after the round: a path that slows the engine (CPU taken from it on
    # a small host) shows here, one that only adds latency does not.
    step_ms_p50: float = 0.0
    # CPU seconds per 1000 output tokens over the round, by process: the
    # pod, smg, and this client. On 2 cores they all share the CPU the
    # engine's steps need.
    pod_cpu: float = 0.0
    smg_cpu: float = 0.0
    client_cpu: float = 0.0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def _run(
    one: Callable[[str], Awaitable[Timing]], prompts: list[str], concurrency: int
) -> tuple[list[Timing], float]:
    gate = asyncio.Semaphore(concurrency)

    async def guarded(prompt: str) -> Timing:
        async with gate:
            return await one(prompt)

    start = time.perf_counter()
    timings = await asyncio.gather(*(guarded(p) for p in prompts))
    return list(timings), time.perf_counter() - start


def _round(path: str, concurrency: int, timings: list[Timing], seconds: float) -> Round:
    ttfts = [t.ttft * 1000 for t in timings]
    itls = [g * 1000 for t in timings for g in t.itls()]
    return Round(
        path,
        concurrency,
        sum(t.tokens for t in timings) / seconds,
        _pct(ttfts, 0.5),
        _pct(ttfts, 0.99),
        _pct(itls, 0.5),
        _pct(itls, 0.99),
    )


# The model every request names: the base, or (--lora) the adapter.
MODEL_NAME = MODEL
LORA_NAME = ""


async def direct_round(target: str, prompts: list[str], output_len: int, concurrency: int) -> Round:
    async with TandemClient(target) as client:

        async def one(prompt: str) -> Timing:
            timing = Timing(time.perf_counter())
            request = make_request(
                text=prompt,
                max_tokens=output_len,
                temperature=0.0,
                ignore_eos=True,
                lora_name=LORA_NAME,
            )
            async for chunk in client.stub.Generate(request):
                if chunk.token_ids:
                    timing.chunks.append((time.perf_counter(), len(chunk.token_ids)))
            return timing

        timings, seconds = await _run(one, prompts, concurrency)
    return _round("direct", concurrency, timings, seconds)


def _completion_body(prompt: str, output_len: int) -> dict[str, object]:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


async def _sse_events(
    http: httpx2.AsyncClient, url: str, body: dict[str, object]
) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of one streamed completion, parsed as `vllm bench
    serve` parses them (raw SSE lines, json.loads): the client's own CPU is
    taken from the 2 cores the pod computes on, and the openai package's
    typed objects cost about 4x the protobuf client's CPU per token."""
    async with http.stream("POST", f"{url}/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"smg answered {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            yield json.loads(line[6:])


def _lean_http() -> httpx2.AsyncClient:
    # httpx2 is the transport the openai package itself uses.
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx2.AsyncClient(timeout=600, limits=limits)


async def smg_round(url: str, prompts: list[str], output_len: int, concurrency: int) -> Round:
    async with _lean_http() as http:

        async def one(prompt: str) -> Timing:
            timing = Timing(time.perf_counter())
            seen = 0
            async for event in _sse_events(http, url, _completion_body(prompt, output_len)):
                now = time.perf_counter()
                usage = event.get("usage")
                if usage:  # the last event: attribute the rest
                    extra = usage["completion_tokens"] - seen
                    if extra > 0 and timing.chunks:
                        t, n = timing.chunks[-1]
                        timing.chunks[-1] = (t, n + extra)
                    continue
                choices = event.get("choices")
                if choices and choices[0].get("text"):
                    timing.chunks.append((now, 1))
                    seen += 1
            return timing

        timings, seconds = await _run(one, prompts, concurrency)
    return _round("smg", concurrency, timings, seconds)


async def ttft_pairs(target: str, url: str, prompts: list[str]) -> list[tuple[float, float]]:
    """Time to first token, one request at a time, over `prompts` (none
    repeated: no prefix-cache hit), on connections opened once. Pairs run
    in ABBA order (direct first, then smg first, ...) so a drift in the
    host's speed cancels. Returns (direct ms, smg ms) per pair."""
    async with TandemClient(target) as client, _lean_http() as http:

        async def direct(prompt: str) -> float:
            start = time.perf_counter()
            request = make_request(
                text=prompt, max_tokens=4, temperature=0.0, ignore_eos=True, lora_name=LORA_NAME
            )
            first = 0.0
            async for chunk in client.stub.Generate(request):
                if chunk.token_ids and not first:
                    first = time.perf_counter() - start
            return first * 1000

        async def via_smg(prompt: str) -> float:
            start = time.perf_counter()
            first = 0.0
            async for event in _sse_events(http, url, _completion_body(prompt, 4)):
                choices = event.get("choices")
                if choices and choices[0].get("text") and not first:
                    first = time.perf_counter() - start
            return first * 1000

        pairs = []
        for i in range(len(prompts) // 2):
            a, b = prompts[2 * i], prompts[2 * i + 1]
            if i % 2 == 0:
                d = await direct(a)
                s = await via_smg(b)
            else:
                s = await via_smg(a)
                d = await direct(b)
            pairs.append((d, s))
    return pairs


def random_prompts(n: int, length: int, seed: int) -> list[str]:
    """`length` random whole-word tokens each (" house", " green": one token
    each, so the text is about `length` tokens). Words, not arbitrary ids:
    a continuation of byte soup is byte soup, whose incomplete UTF-8 smg
    holds back, which would make its chunks fewer than its tokens."""
    from engine.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(None))
    words = sorted(t.lstrip("Ġ") for t in tokenizer.get_vocab() if re.fullmatch(r"Ġ[a-z]{3,}", t))
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(length)) for _ in range(n)]


@contextmanager
def _proc(cmd: list[str], name: str) -> Iterator[int]:
    log = Path(tempfile.gettempdir()) / f"gateway-bench-{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=out)
    try:
        yield proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def stack(max_num_seqs: int, adapter: Path | None) -> Iterator[tuple[str, str, int, int]]:
    """(pod address, smg's OpenAI URL, pod pid, smg pid): `tandem gateway`
    becomes smg (exec), so its pid is smg's. With `adapter`, the pod serves
    it as LORA_NAME, also on its own port, smg's second worker."""
    port, http = free_port(), free_port()
    tandem = [sys.executable, "-m", "service.cli", "--log-level", "warning"]
    serve = [*tandem, "serve", "--port", str(port), "--max-num-seqs", str(max_num_seqs)]
    gateway = [*tandem, "gateway", "--worker", f"127.0.0.1:{port}", "--port", str(http)]
    if adapter is not None:
        lora_port = free_port()
        serve += ["--enable-lora", "--lora-modules", f"{LORA_NAME}={adapter}"]
        serve += ["--lora-port", f"{LORA_NAME}={lora_port}"]
        gateway += ["--worker", f"127.0.0.1:{lora_port}"]
    gateway += ["--prometheus-port", str(free_port()), "--", "--log-level", "warn"]
    target, url = f"127.0.0.1:{port}", f"http://127.0.0.1:{http}/v1"
    with _proc(serve, "serve") as pod:
        asyncio.run(wait_serving(target))
        with _proc(gateway, "smg") as smg:
            _wait_gateway(url)
            yield target, url, pod, smg


def _wait_gateway(url: str, timeout: float = 120.0) -> None:
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=1)
            return
        except openai.OpenAIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


async def _step_ms(target: str) -> float:
    async with TandemClient(target) as client:
        return (await client.status()).recent_step_ms_p50


def _load() -> float:
    return os.getloadavg()[0]


def _summary(rounds: list[Round]) -> None:
    metrics = (
        "tokens_per_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "step_ms_p50",
        "pod_cpu",
        "smg_cpu",
        "client_cpu",
    )
    for c in sorted({r.concurrency for r in rounds}):
        runs = sum(r.concurrency == c and r.path == "smg" for r in rounds)
        print(f"\nconcurrency {c}: median (min-max) over {runs} rounds per path")
        print(f"  {'metric':<14} {'direct':>22} {'smg':>22} {'smg/direct':>11} {'smg-direct':>11}")
        for m in metrics:
            a = [getattr(r, m) for r in rounds if r.concurrency == c and r.path == "direct"]
            b = [getattr(r, m) for r in rounds if r.concurrency == c and r.path == "smg"]
            ma, mb = statistics.median(a), statistics.median(b)
            print(
                f"  {m:<14} {ma:>9.1f} ({min(a):.1f}-{max(a):.1f}) "
                f"{mb:>9.1f} ({min(b):.1f}-{max(b):.1f}) {mb / ma if ma else 0:>11.3f} "
                f"{mb - ma:>+11.1f}"
            )


def _report_ttft(target: str, url: str, pairs: int, length: int) -> None:
    """Added TTFT at concurrency 1: the median and mean of the per-pair
    differences (smg - direct), the mean with twice its standard error."""
    asyncio.run(ttft_pairs(target, url, random_prompts(4, length, seed=8)))  # warm
    timed = asyncio.run(ttft_pairs(target, url, random_prompts(2 * pairs, length, seed=7)))
    direct, via_smg = [d for d, _ in timed], [s for _, s in timed]
    diffs = [s - d for d, s in timed]
    mean, se = statistics.mean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5
    print(
        f"TTFT at c=1, {length}-word prompts, {pairs} pairs: direct "
        f"{statistics.median(direct):.1f} ms ({min(direct):.1f}-{max(direct):.1f}), smg "
        f"{statistics.median(via_smg):.1f} ms ({min(via_smg):.1f}-{max(via_smg):.1f}); "
        f"added: median {statistics.median(diffs):+.1f} ms, mean {mean:+.1f} +- {2 * se:.1f} ms "
        f"(load {_load():.2f})",
        flush=True,
    )


def _make_adapter(out: Path) -> Path:
    """tests/lora_adapters.py's qv8 adapter (peft, seeded) under `out`;
    names every request after it from now on."""
    global MODEL_NAME, LORA_NAME
    from engine.models.loader import resolve_model
    from tests.lora_adapters import ADAPTERS, make_adapters

    spec = ADAPTERS[0]
    MODEL_NAME = LORA_NAME = spec.name
    return make_adapters(resolve_model(None), out, (spec,))[spec.name]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", default="1,64", help="comma-separated (default: 1,64)")
    p.add_argument("--rounds", type=int, default=3, help="per path and concurrency (default: 3)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (default: 64)")
    p.add_argument(
        "--requests", type=int, default=0, help="per round (default: 2 x concurrency, >= 8)"
    )
    p.add_argument(
        "--ttft-pairs",
        type=int,
        default=40,
        help="first, this many single requests per path, alternating, for the added TTFT "
        "(default: 40; 0 skips)",
    )
    p.add_argument(
        "--ttft-input-len",
        default="16,128",
        help="prompt lengths for --ttft-pairs, comma-separated (default: 16,128)",
    )
    p.add_argument("--lora", action="store_true", help="every request under a LoRA adapter")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    rounds: list[Round] = []
    adapter = (
        _make_adapter(Path(tempfile.mkdtemp(prefix="gateway-bench-lora-"))) if args.lora else None
    )
    print(f"load average before: {_load():.2f}" + (f"; adapter {LORA_NAME}" if adapter else ""))
    with stack(max(levels), adapter) as (target, url, pod, smg):
        for length in (int(x) for x in args.ttft_input_len.split(",") if args.ttft_pairs):
            _report_ttft(target, url, args.ttft_pairs, length)
        for c in levels:
            n = args.requests or max(8, 2 * c)
            # Warm both paths (allocator, smg's connection) on other prompts.
            warm = random_prompts(min(n, 8), args.input_len, seed=-c)
            asyncio.run(direct_round(target, warm, 4, c))
            asyncio.run(smg_round(url, warm, 4, c))
            for i in range(args.rounds):
                for j, path in enumerate(("direct", "smg")):
                    # Fresh prompts for each run: none may hit the prefix
                    # cache the other path's run just filled.
                    prompts = random_prompts(n, args.input_len, seed=1000 * c + 2 * i + j)
                    cpu = (_cpu_seconds(pod), _cpu_seconds(smg), _own_cpu())
                    if path == "direct":
                        r = asyncio.run(direct_round(target, prompts, args.output_len, c))
                    else:
                        r = asyncio.run(smg_round(url, prompts, args.output_len, c))
                    used = (_cpu_seconds(pod), _cpu_seconds(smg), _own_cpu())
                    per_k = 1000 / (n * args.output_len)
                    r.pod_cpu, r.smg_cpu, r.client_cpu = (
                        (b - a) * per_k for a, b in zip(cpu, used, strict=True)
                    )
                    r.step_ms_p50 = asyncio.run(_step_ms(target))
                    rounds.append(r)
                    print(
                        f"c={c} round {i} {path:<6} {r.tokens_per_s:8.1f} tok/s  "
                        f"TTFT p50 {r.ttft_p50_ms:7.1f} ms  ITL p50 {r.itl_p50_ms:6.1f} ms  "
                        f"pod step p50 {r.step_ms_p50:6.1f} ms  "
                        f"(load {_load():.2f})",
                        flush=True,
                    )
    _summary(rounds)
    print(f"\nload average after: {_load():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
