"""A burst of P/D streams at a KV cache size that makes the decode pod preempt.

Issue 38's check: N concurrent greedy chats through `tandem router` to a
prefill and a decode pod (NIXL by default, or the shared-memory or Redis
connector), each pod with a small KV cache, against a colocated server's
answers to the same chats. Every answer must be identical or an explicit
error; none may come back OK with other text. Prints the counts, the decode
pod's preemptions and recomputed tokens, its transfer failures by kind,
the prefill pod's lapsed holds, and the wall time of each run.

Not a speed benchmark: the colocated run is only the reference.

    .venv/bin/python benchmarks/pd_preemption_burst.py [--streams 300] \\
        [--connector nixl|shm|redis] [--kv-cache-memory 512M] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import grpc  # noqa: E402
from pd_bench import _process, _redis  # noqa: E402

from service.client import TandemClient, make_request  # noqa: E402
from service.gen.tandem.v1 import generation_pb2 as pb  # noqa: E402

TOPICS = ["gravity", "rivers", "bees", "volcanoes", "the moon", "bread", "chess", "glaciers"]


def _prompts(n: int) -> list[str]:
    return [
        f"Question {i}: in three sentences, explain {TOPICS[i % len(TOPICS)]} to a child."
        for i in range(n)
    ]


async def _answer(target: str, prompt: str, max_tokens: int) -> list[int] | str:
    """The token ids of one greedy chat, or the error it ended with."""
    request = make_request(text=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens: list[int] = []
    try:
        async with TandemClient(target) as client:
            async for chunk in client.stub.Generate(request, timeout=900):
                tokens.extend(chunk.token_ids)
    except grpc.aio.AioRpcError as e:
        return f"{e.code().name}: {e.details()}"
    return tokens


async def _burst(target: str, prompts: list[str], max_tokens: int) -> list[list[int] | str]:
    return list(await asyncio.gather(*(_answer(target, p, max_tokens) for p in prompts)))


async def _status(target: str) -> pb.ServerStatus:
    async with TandemClient(target) as client:
        return await client.status()


def _kv(connector: str, role: str, extra: dict[str, object]) -> list[str]:
    config = {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra}
    return ["--kv-transfer-config", json.dumps(config)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--connector", choices=["nixl", "shm", "redis"], default="nixl")
    parser.add_argument("--kv-cache-memory", default="512M")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    prompts = _prompts(args.streams)
    cache = ["--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "1024"]
    with ExitStack() as stack:
        extra: dict[str, object] = {}
        if args.connector == "redis":
            extra = {"url": stack.enter_context(_redis()), "key_prefix": "burst:"}
        elif args.connector == "shm":
            extra = {"pool_name": f"burst-{uuid.uuid4().hex[:8]}", "capacity_bytes": 1 << 30}
        colocated = stack.enter_context(_process("serve", "--max-num-seqs", "256"))
        start = time.perf_counter()
        want = asyncio.run(_burst(colocated, prompts, args.max_tokens))
        colocated_s = time.perf_counter() - start
        prefill = stack.enter_context(
            _process(
                "serve", "--role", "prefill", *cache, *_kv(args.connector, "kv_producer", extra)
            )
        )
        decode = stack.enter_context(
            _process(
                "serve", "--role", "decode", *cache, *_kv(args.connector, "kv_consumer", extra)
            )
        )
        router = stack.enter_context(_process("router", "--prefill", prefill, "--decode", decode))
        start = time.perf_counter()
        got = asyncio.run(_burst(router, prompts, args.max_tokens))
        pd_s = time.perf_counter() - start
        dec = asyncio.run(_status(decode))
        pre = asyncio.run(_status(prefill))
    _report(args, got, want, dec, pre, colocated_s, pd_s)


def _report(
    args: argparse.Namespace,
    got: list[list[int] | str],
    want: list[list[int] | str],
    dec: pb.ServerStatus,
    pre: pb.ServerStatus,
    colocated_s: float,
    pd_s: float,
) -> None:
    identical = sum(g == w for g, w in zip(got, want, strict=True))
    errors = [g for g in got if isinstance(g, str)]
    wrong = [
        i
        for i, (g, w) in enumerate(zip(got, want, strict=True))
        if g != w and not isinstance(g, str)
    ]
    print(
        f"{args.streams} streams over {args.connector}, {args.kv_cache_memory} of KV a pod, "
        f"{args.max_tokens} tokens each"
    )
    print(f"  identical {identical}, explicit errors {len(errors)}, OK but different {len(wrong)}")
    if errors:
        print(f"  first error: {errors[0]}")
    if wrong:
        print(f"  different: streams {wrong[:20]}")
    print(
        f"  decode pod: {dec.num_preemptions} preemptions, {dec.kv_recomputed_tokens} tokens "
        f"recomputed, transfer failures {dict(dec.kv_transfer_failures)}"
    )
    print(f"  prefill pod: {pre.kv_leases_lapsed} holds lapsed")
    print(f"  wall time: colocated {colocated_s:.1f} s, P/D {pd_s:.1f} s")


if __name__ == "__main__":
    main()
