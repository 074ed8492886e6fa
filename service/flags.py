"""Command-line flags that more than one command takes (``tandem serve``,
``tandem bench``): here, not in service/cli.py, so that a command module
the CLI imports can use them without importing the CLI back."""

from __future__ import annotations

import argparse

from service.knob_flags import add_knob_flag, knob


def add_quantization_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--quantization, --exact and --int8-activations (ModelConfig's fields
    of the same names, declared there; engine/models/weight_plan.py says what
    each quantization does, engine/numerics.py what the other two resolve to)."""
    for name in ("quantization", "exact", "int8_activations"):
        add_knob_flag(p, knob("model", name))
