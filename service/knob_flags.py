"""Engine knobs as command-line flags, generated from their declaration
(``engine.config.knob``: name, type, default, help and flag live there,
once). ``tandem serve`` takes every knob this way; other commands that
start or mimic a server (``tandem bench``) take the ones they need."""

from __future__ import annotations

import argparse
from typing import Any

from engine.config import EngineConfig, KnobField, engine_knobs

ENGINE_KNOBS: tuple[KnobField, ...] = tuple(engine_knobs())


def knob(section: str, name: str) -> KnobField:
    """The declared knob ``EngineConfig.<section>.<name>``."""
    for k in ENGINE_KNOBS:
        if (k.section, k.name) == (section, name):
            return k
    raise KeyError(f"no knob {section}.{name}")


def add_knob_flag(p: argparse.ArgumentParser | argparse._ArgumentGroup, k: KnobField) -> None:
    """The flag of one knob. A knob of a section that is off unless asked
    for (KV transfer, LoRA) has no default of its own: given, it overrides
    the section's (``knob_values``)."""
    override = getattr(EngineConfig(), k.section) is None
    help = k.knob.help if k.negated else f"{k.knob.help} (default: {k.default_text})"
    if k.type is bool and k.default is None:
        # Unset until given (resolved later, e.g. engine/numerics.py): the
        # flag alone is true, and "true"/"false" say which.
        p.add_argument(k.flag, nargs="?", const=True, type=parse_bool, default=None, help=help)
        return
    if k.type is bool:
        p.add_argument(k.flag, action="store_true", default=None if override else False, help=help)
        return
    if k.many:
        # Unset (None) until given; the field's default then applies.
        p.add_argument(k.flag, nargs="+", type=k.type, default=None, metavar="N", help=help)
        return
    p.add_argument(
        k.flag,
        type=parse_size if k.knob.size else k.type,
        default=None if override else k.default,
        choices=list(k.choices) or None,
        help=help,
    )


def knob_values(args: argparse.Namespace, section: str) -> dict[str, Any]:
    """The fields of one EngineConfig section that its flags set."""
    out = {}
    for k in ENGINE_KNOBS:
        if k.section == section and (given := getattr(args, k.dest, None)) is not None:
            out[k.name] = k.value(given)
    return out


def parse_bool(text: str) -> bool:
    """true/false (also yes/no, on/off, 1/0), in any case."""
    t = text.strip().lower()
    if t in ("true", "yes", "on", "1"):
        return True
    if t in ("false", "no", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


def parse_size(text: str) -> int:
    """Bytes from 2G, 512M, 1.5k or 1048576 (binary units)."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size like 2G, 512M or 1048576"
        ) from None
