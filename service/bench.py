"""Serving benchmark: Poisson arrivals against a Tandem server.

For each request rate of the sweep, requests with mixed prompt lengths
arrive as a Poisson process and stream their answers; the run reports
output tokens/s and p50/p99 of time to first token (TTFT), inter-token
latency (ITL) and end-to-end latency. In the same run, the offline engine
(LLM.generate) processes the same requests, which gives the service's
efficiency at saturation (rate inf: everything at once) and its per-token
overhead (service p50 ITL minus the engine's p50 decode step time).

Without --server it starts `tandem serve` on a free port. The server stays
up but idle while the offline engine runs, so the two never share the CPU;
`--compare-rounds N` repeats the saturated service round and the offline
run N times, interleaved, and reports medians. Results go to
JSON, with a PNG beside it: latency CDFs per rate, and throughput and p99
latency against the request rate.

    tandem bench --rates 1,2,inf --num-requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm  # type: ignore[import-untyped]

from service.flags import add_quantization_flags


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", help="bench this running server (default: start one)")
    p.add_argument("--model", help="model for the started server and the offline run")
    add_quantization_flags(p)  # as --model: the started server's and the offline run's
    p.add_argument(
        "--rates",
        default="1,2,inf",
        help="comma-separated requests/s; inf sends all at once (default: 1,2,inf)",
    )
    p.add_argument("--num-requests", type=int, default=64, help="per rate (default: 64)")
    p.add_argument("--min-prompt", type=int, default=32, help="tokens (default: 32)")
    p.add_argument("--max-prompt", type=int, default=512, help="tokens (default: 512)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens (default: 128)")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrivals (default: 0)")
    p.add_argument("--no-offline", action="store_true", help="skip the offline comparison")
    p.add_argument(
        "--compare-rounds",
        type=int,
        default=1,
        help="saturated service rounds and offline rounds, interleaved, for the "
        "throughput comparison (default: 1)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/results/serving_bench.json"),
        help="JSON results; the PNG goes beside it",
    )
    p.add_argument("--api-key", help="the server's API key")


@dataclass
class RequestResult:
    prompt_len: int
    sent: float
    token_times: list[float] = field(default_factory=list)
    done: float = 0.0
    error: str | None = None


@dataclass
class RateResult:
    rate: float
    duration: float
    output_tokens: int
    errors: int
    throughput: float
    ttft: list[float]
    itl: list[float]
    e2e: list[float]
    server_step_ms_p50: float = math.nan
    # Each step counted once per inter-token gap it ended (the ITL's reference).
    server_token_step_ms_p50: float = math.nan

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {
            "rate": self.rate,
            "throughput_tok_s": self.throughput,
            "server_step_p50_ms": self.server_step_ms_p50,
            "server_token_step_p50_ms": self.server_token_step_ms_p50,
        }
        for name in ("ttft", "itl", "e2e"):
            values = getattr(self, name)
            out[f"{name}_p50_ms"] = _pct(values, 50) * 1e3
            out[f"{name}_p99_ms"] = _pct(values, 99) * 1e3
        return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def make_prompts(args: argparse.Namespace, vocab: int, round_index: int) -> list[list[int]]:
    """Random prompts, different for every rate of the sweep: a repeated
    prompt would hit the prefix cache and skip its prefill."""
    rng = random.Random(args.seed * 1000 + round_index)
    return [
        [rng.randrange(100, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        for _ in range(args.num_requests)
    ]


# --- the service side ------------------------------------------------------------------


async def _one(
    client: Any, prompt: list[int], max_tokens: int, delay: float, result: RequestResult, bar: Any
) -> None:
    await asyncio.sleep(delay)
    result.sent = time.perf_counter()
    try:
        async for chunk in client.generate(
            token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ):
            now = time.perf_counter()
            result.token_times.extend([now] * len(chunk.token_ids))
    except Exception as exc:  # reported, not fatal: the run goes on
        result.error = f"{type(exc).__name__}: {exc}"
    result.done = time.perf_counter()
    bar.update(1)


async def run_rate(
    client: Any, prompts: list[list[int]], rate: float, max_tokens: int, seed: int
) -> RateResult:
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    results = [RequestResult(len(p), 0.0) for p in prompts]
    with tqdm(total=len(prompts), desc=f"rate {rate:g} req/s", unit="req") as bar:
        start = time.perf_counter()
        await asyncio.gather(
            *(
                _one(client, p, max_tokens, d, r, bar)
                for p, d, r in zip(prompts, delays, results, strict=True)
            )
        )
        duration = time.perf_counter() - start
    ok = [r for r in results if r.error is None and r.token_times]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    tokens = sum(len(r.token_times) for r in ok)
    return RateResult(
        rate=rate,
        duration=duration,
        output_tokens=tokens,
        errors=len(results) - len(ok),
        throughput=tokens / duration,
        ttft=[r.token_times[0] - r.sent for r in ok],
        itl=itl,
        e2e=[r.done - r.sent for r in ok],
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    return subprocess.Popen(_server_command(args, port)), f"127.0.0.1:{port}"


def _server_command(args: argparse.Namespace, port: int) -> list[str]:
    """`tandem serve` with the bench's model flags (the offline run's too)."""
    cmd = [
        sys.executable,
        "-m",
        "service.cli",
        "--log-level",
        "warning",
        "serve",
        "--port",
        str(port),
        "--quantization",
        args.quantization,
    ]
    if args.model:
        cmd += ["--model", args.model]
    if args.exact:
        cmd.append("--exact")
    if args.int8_activations is not None:
        cmd += ["--int8-activations", str(args.int8_activations).lower()]
    return cmd


@dataclass
class Comparison:
    """One interleaved pair: the service saturated, then the offline engine on
    the same prompts."""

    service: RateResult
    offline: dict[str, float]

    @property
    def ratio(self) -> float:
        return self.service.throughput / self.offline["throughput_tok_s"]

    @property
    def overhead_ms(self) -> float:
        # ITL is per token, so the step time it is compared with is per token
        # too: a step serving 64 streams counts 64 times, a tail step with one
        # stream left once.
        return self.service.summary()["itl_p50_ms"] - self.service.server_token_step_ms_p50


async def _measure(
    client: Any, prompts: list[list[int]], rate: float, args: argparse.Namespace, seed: int
) -> RateResult:
    result = await run_rate(client, prompts, rate, args.max_tokens, seed)
    # The server's own step times (its last 128 steps: this round's).
    status = await client.status()
    result.server_step_ms_p50 = status.recent_step_ms_p50
    result.server_token_step_ms_p50 = status.recent_token_step_ms_p50
    return result


async def bench(
    args: argparse.Namespace, rates: list[float]
) -> tuple[list[RateResult], list[Comparison]]:
    """The sweep, then the saturated comparison rounds (service, offline,
    service, offline, ...). The server stays up but idle while the offline
    engine runs, so the two never share the CPU, and the noise of this
    shared host falls on both sides alike."""
    from service.client import TandemClient, wait_serving

    proc, target = (None, args.server) if args.server else _start_server(args)
    try:
        await wait_serving(target, alive=lambda: proc is None or proc.poll() is None)
        async with TandemClient(target, api_key=args.api_key) as client:
            vocab = (await client.model_info()).vocab_size
            # One short request first: connection set-up is not part of the figures.
            async for _ in client.generate(token_ids=[1000, 1001], max_tokens=2):
                pass
            results = [
                await _measure(client, make_prompts(args, vocab, i), rate, args, args.seed + i)
                for i, rate in enumerate(rates)
            ]
            if args.no_offline:
                return results, []
            return results, await _compare(args, client, vocab, results, rates)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)


async def _compare(
    args: argparse.Namespace,
    client: Any,
    vocab: int,
    results: list[RateResult],
    rates: list[float],
) -> list[Comparison]:
    from engine.llm import LLM

    llm = LLM(
        args.model,
        quantization=args.quantization,
        exact=args.exact,
        int8_activations=args.int8_activations,
    )
    # Round 0 reuses the sweep's saturated round; later rounds get new prompts
    # (a repeated prompt would hit the server's prefix cache).
    top = max(range(len(rates)), key=lambda i: rates[i])
    pairs = []
    for k in range(args.compare_rounds):
        index = top if k == 0 else len(rates) + k
        prompts = make_prompts(args, vocab, index)
        service = (
            results[top]
            if k == 0
            else await _measure(client, prompts, rates[top], args, args.seed + index)
        )
        pairs.append(Comparison(service, bench_offline(llm, args, prompts)))
        print(
            f"comparison round {k + 1}: service {service.throughput:.1f} tok/s, offline "
            f"{pairs[-1].offline['throughput_tok_s']:.1f} tok/s ({pairs[-1].ratio:.1%}); "
            f"per-token overhead {pairs[-1].overhead_ms:+.2f} ms"
        )
    return pairs


# --- the offline side ---------------------------------------------------------------


def bench_offline(llm: Any, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    """The offline engine on the same requests: output tokens/s and the p50
    duration of its decode steps (steps that scheduled one token per request)."""
    from engine.sampling_params import SamplingParams

    core = llm.core
    step_times: list[float] = []
    inner = core.step

    def timed_step() -> Any:
        start = time.perf_counter()
        out = inner()
        step_times.append(time.perf_counter() - start)
        return out

    core.step = timed_step
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    finally:
        core.step = inner
    tokens = sum(len(o.token_ids) for o in outs)
    # The last max_tokens/2 steps are decode-only for this workload.
    decode_steps = step_times[-(args.max_tokens // 2) :]
    return {
        "throughput_tok_s": tokens / elapsed,
        "decode_step_p50_ms": statistics.median(decode_steps) * 1e3,
    }


# --- report ---------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    rates = [float(r) for r in args.rates.split(",")]
    results, pairs = asyncio.run(bench(args, rates))
    report: dict[str, Any] = {
        "config": {k: str(v) for k, v in vars(args).items() if k != "run"},
        "rates": [r.summary() | {"errors": r.errors} for r in results],
    }
    for r in results:
        s = r.summary()
        print(
            f"rate {r.rate:>5g} req/s: {r.throughput:7.1f} tok/s; TTFT p50 "
            f"{s['ttft_p50_ms']:.0f} p99 {s['ttft_p99_ms']:.0f} ms; ITL p50 "
            f"{s['itl_p50_ms']:.1f} p99 {s['itl_p99_ms']:.1f} ms; E2E p50 "
            f"{s['e2e_p50_ms']:.0f} p99 {s['e2e_p99_ms']:.0f} ms; errors {r.errors}"
        )
    if pairs:
        report["service_vs_offline"] = _report_comparison(pairs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report["raw"] = [asdict(r) for r in results]
    args.out.write_text(json.dumps(report, indent=1))
    png = args.out.with_suffix(".png")
    plot(results, png)
    print(f"results: {args.out} and {png}")
    return 0


def _spread(values: list[float], fmt: str) -> str:
    """median (min-max)"""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}} to {max(values):{fmt}})"


def _report_comparison(pairs: list[Comparison]) -> dict[str, Any]:
    ratios = [p.ratio for p in pairs]
    overheads = [p.overhead_ms for p in pairs]
    offline = [p.offline["throughput_tok_s"] for p in pairs]
    service = [p.service.throughput for p in pairs]
    step_ratios = [p.service.server_step_ms_p50 / p.offline["decode_step_p50_ms"] for p in pairs]
    print(
        f"saturated, {len(pairs)} interleaved round(s), median (min to max): service "
        f"{_spread(service, '.1f')} tok/s, offline {_spread(offline, '.1f')} tok/s\n"
        f"  service / offline throughput {_spread(ratios, '.1%')}\n"
        f"  per-token overhead (ITL p50 - server step p50 per token) "
        f"{_spread(overheads, '+.2f')} ms\n"
        f"  server decode step / offline decode step {_spread(step_ratios, '.2f')}"
    )
    return {
        "rounds": [
            {
                "service_tok_s": p.service.throughput,
                "offline": p.offline,
                "throughput_ratio": p.ratio,
                "itl_minus_server_token_step_ms": p.overhead_ms,
                "server_step_p50_ms": p.service.server_step_ms_p50,
            }
            for p in pairs
        ],
        "throughput_ratio_median": statistics.median(ratios),
        "overhead_ms_median": statistics.median(overheads),
    }


def plot(results: list[RateResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, name, title in zip(
        axes[:3],
        ("ttft", "itl", "e2e"),
        ("time to first token", "inter-token latency", "end to end"),
        strict=True,
    ):
        for r in results:
            values = sorted(getattr(r, name))
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.plot([v * 1e3 for v in values], ys, label=f"{r.rate:g} req/s")
        ax.set_xscale("log")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if name != "itl" else "fraction of tokens")
        ax.set_title(f"CDF: {title}")
        ax.legend()
    finite = [r for r in results if math.isfinite(r.rate)]
    ax = axes[3]
    if finite:
        xs = [r.rate for r in finite]
        ax.plot(xs, [r.throughput for r in finite], "o-", label="throughput (tok/s)")
        ax2 = ax.twinx()
        ax2.plot(
            xs,
            [_pct(r.e2e, 99) for r in finite],
            "s--",
            color="tab:red",
            label="p99 end to end (s)",
        )
        ax2.set_ylabel("p99 end to end (s)")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("output tokens/s")
        ax.set_title("throughput and p99 latency vs rate")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
