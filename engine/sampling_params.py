"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The hottest temperature accepted. Over logits that span ~50 nats (as a
# language model's do) 100 already leaves every token within a factor e^0.5
# of uniform, so nothing useful lies above it; what does (inf, 1e30) is a
# client's mistake that would sample noise.
MAX_TEMPERATURE = 100.0


class SamplingParamsError(ValueError):
    """A sampling value is invalid. ``field`` names the offending parameter."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(field_name, message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Validated on construction; a bad value raises SamplingParamsError.

    ``temperature == 0`` is greedy; at most ``MAX_TEMPERATURE``, and finite.
    ``top_k == 0`` and ``top_p == 1`` disable those filters; ``top_k == -1``
    (vLLM's spelling of "off") is stored as 0, other negative values are
    refused. ``logprobs`` is the number of top alternatives returned with
    each sampled token (None: no logprobs). ``prompt_logprobs`` (vLLM's
    field) asks for the logprob of each prompt token given the tokens
    before it, with this many top alternatives (0: the prompt token's own
    only; None: off); the first prompt token has none. Such a request never
    reads the prefix cache (a cached token's logits are never computed).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.top_k == -1 and _is_int(self.top_k):
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        _check(_is_int(self.max_tokens), "max_tokens", f"must be an int, got {self.max_tokens!r}")
        _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(_is_int(self.min_tokens), "min_tokens", f"must be an int, got {self.min_tokens!r}")
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        _check(
            isinstance(self.temperature, int | float)
            and not isinstance(self.temperature, bool)
            and math.isfinite(self.temperature)
            and 0 <= self.temperature <= MAX_TEMPERATURE,
            "temperature",
            f"must be in [0, {MAX_TEMPERATURE:g}] (0 is greedy), got {self.temperature!r}",
        )
        _check(
            isinstance(self.top_p, int | float) and 0 < self.top_p <= 1,
            "top_p",
            f"must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            _is_int(self.top_k) and self.top_k >= 0,
            "top_k",
            f"must be -1 or 0 (off) or a positive int, got {self.top_k!r}",
        )
        _check(
            self.seed is None or _is_int(self.seed),
            "seed",
            f"must be an int or None, got {self.seed!r}",
        )
        for s in self.stop:
            _check(
                isinstance(s, str) and s != "",
                "stop",
                f"entries must be non-empty strings, got {s!r}",
            )
        for t in self.stop_token_ids:
            _check(_is_int(t) and t >= 0, "stop_token_ids", f"entries must be ints >= 0, got {t!r}")
        _check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            "logprobs",
            f"must be None or an int in [0, 20], got {self.logprobs!r}",
        )
        _check(
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
            "prompt_logprobs",
            f"must be None or an int in [0, 20], got {self.prompt_logprobs!r}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
