"""Where a command's model and engine options come from: the model folder (default: the bundled
model), its dtype, and the engine options the user gave as flags (on top of the preset)."""

from __future__ import annotations

import argparse


def resolve_model_settings(args: argparse.Namespace) -> tuple[str, str | None, dict]:
    """(model path, dtype, engine options from flags) for `LLM(model, dtype, config=
    args.config, **options)`, which puts the flags on top of the preset."""
    return args.model or default_model_dir(), args.dtype, flag_options(args)


def flag_options(args: argparse.Namespace) -> dict:
    """The engine options the user gave as flags (they override the preset's)."""
    from jaxserve.config.engine import option_specs

    options = {spec.name: getattr(args, spec.name) for spec in option_specs()
               if getattr(args, spec.name) is not None}
    return {name: tuple(v) if isinstance(v, list) else v for name, v in options.items()}


def default_model_dir() -> str:
    from jaxserve.default_model import DEFAULT_MODEL_DIR

    return str(DEFAULT_MODEL_DIR)
