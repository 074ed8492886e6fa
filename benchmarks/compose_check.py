"""A composition check, not a benchmark: everything on at once against the
plain run (drafts, n-gram k=3; asynchronous scheduling; a JSON schema; a LoRA
adapter; a 32-token budget; a cache small enough to preempt). Prints how many
of 16 greedy answers equal the plain engine's, and fails unless all do.
Both run the exact path (`exact=True`): the fast CPU default (int8
activations, a bfloat16 cache) is not batch- or chunk-invariant, so a
32-token budget or drafts may part its answers at a near tie (measured
14/16 on it, 2026-11-28). ``--kv-cache-dtype int8`` runs both engines over
an int8 KV cache instead (float activations): not invariant either, since
its decode steps take integer arithmetic (a rounded query) where prefill
chunks and draft verification read the rows as floats (12/16 on
2026-11-29; 15/16 once prompt rows take the prefill kernels and output rows
the decode kernels, AttentionMetadata.prompt_rows; every answer complete,
none an error). Its float activations are not batch-invariant either.

    .venv/bin/python benchmarks/compose_check.py
    .venv/bin/python benchmarks/compose_check.py --kv-cache-dtype int8
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.config import LoRAConfig, SpeculativeConfig
from engine.llm import LLM
from engine.models.loader import resolve_model
from engine.sampling_params import SamplingParams
from engine.structured_output.params import StructuredOutputParams
from tests.lora_adapters import ADAPTERS, make_adapters

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument(
    "--kv-cache-dtype", default=None, help="both engines' KV cache (default: the exact path)"
)
args = parser.parse_args()
numerics: dict[str, Any] = (
    {"exact": True}
    if args.kv_cache_dtype is None
    else {"kv_cache_dtype": args.kv_cache_dtype, "int8_activations": False}
)
path = resolve_model(None)
adapters = make_adapters(path, Path(tempfile.mkdtemp()), ADAPTERS[:1])
schema = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
chats = [
    [{"role": "user", "content": f"Give me a JSON person number {i}, name and age."}]
    for i in range(4)
]
plain_p = SamplingParams(max_tokens=40, temperature=0.0)
json_p = SamplingParams(
    max_tokens=60,
    temperature=0.0,
    structured_outputs=StructuredOutputParams(json=json.dumps(schema)),
)


def build(**kw: Any) -> LLM:
    lora = LoRAConfig(max_loras=2, max_lora_rank=16)
    llm = LLM(max_model_len=256, lora=lora, **numerics, **kw)
    llm.load_lora("qv8", str(adapters["qv8"]))
    return llm


def run(llm: LLM) -> list[list[int]]:
    out: list[list[int]] = []
    for lora in (None, "qv8"):
        out += [
            o.token_ids
            for o in llm.generate(
                [llm.chat_prompt(c) for c in chats], json_p, lora=lora, use_tqdm=False
            )
        ]
        out += [
            o.token_ids
            for o in llm.generate(
                [llm.chat_prompt(c) for c in chats], plain_p, lora=lora, use_tqdm=False
            )
        ]
    return out


base = run(build(kv_cache_memory=2**26))
allon = build(
    num_blocks_override=18,
    max_num_batched_tokens=32,
    async_scheduling=True,
    speculative=SpeculativeConfig(num_speculative_tokens=3, adaptive=False),
)
got = run(allon)
print("preemptions", allon.totals.num_preemptions, "spec", allon.totals.spec_decoding)
same = sum(a == b for a, b in zip(base, got, strict=True))
print(f"equal {same}/{len(base)}")
for a, b in zip(base, got, strict=True):
    if a != b:
        print("DIFF", list(a)[:12], list(b)[:12])
assert same == len(base)
