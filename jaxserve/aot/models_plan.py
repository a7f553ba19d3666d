"""`jaxserve plan --models models.toml`: every engine of a models file planned together, on
the devices they share, as `jaxserve serve --models` would load them.

Start-up loads the entries in file order, and each engine sizes its KV cache from what its
first device has free once its weights are placed (`Engine`, `choose_num_pages`): on a shared
device the weights and caches of the engines loaded before it count as in use. The walk here
does the same: it keeps the bytes each device index holds, plans each entry with `build_plan`
given those bytes, then adds the entry's weights + KV cache to each of its devices.

The target: every entry names a TPU/GPU preset (`config`), all of one platform and
accelerator. The host has as many devices as the largest of those presets declares (a
preset for fewer devices runs on a bigger host; `devices` options index into it). An entry's
devices are its `devices` option, else the first tensor_parallel_size x data_parallel_size.

When is the whole file fine (`fits`)? When every entry's plan fits with the engines before it
resident, and, once all are loaded, every program still fits on each of its devices next to
every other engine's weights and cache there: an engine loaded later takes a fraction of what
was free, which can leave too little for an earlier engine's temporaries. Programs that share
a device run one at a time (`jaxserve.fleet.device_turns`, one compute stream), so a device's
worst moment is one program's peak plus the other engines' resident bytes. A reload, which
loads new versions while the old ones still serve, is not modelled: this is start-up.

Settings per entry, as at serve time: the preset's engine options with the entry's on top
(`engine_settings`, which also re-derives a ladder whose limit the entry changes); the dtype
is `dtype` when given (a what-if for every entry, as `--dtype` overrides a preset), else the
entry's, else the preset's. Model folders need only their config.json (no weights are read);
an entry `path` that is a shipped reference shape's name (`jaxserve/presets/reference_models`)
is accepted too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxserve.aot.plan import build_plan, mesh_device_indices, plan_target
from jaxserve.aot.report import format_plan
from jaxserve.aot.targets import GIB, Target
from jaxserve.fleet.models_file import ModelEntry, read_models_file
from jaxserve.llm import engine_config_for
from jaxserve.model.hf_config import load_config
from jaxserve.loading.hub import resolve_model
from jaxserve.presets import REFERENCE_MODELS, Preset, engine_settings, load_preset


@dataclasses.dataclass(frozen=True)
class PlannedEntry:
    """One entry resolved and checked, before anything compiles."""

    entry: ModelEntry
    preset: Preset
    model_dir: Path
    options: dict[str, Any]  # the engine options at serve time (preset + entry)
    devices: tuple[int, ...]  # the target's device indices its mesh uses


def resolve_entries(path: str | Path) -> tuple[Target, list[PlannedEntry]]:
    """The target and the checked entries of the models file at `path`: a `ValueError` naming
    the entry for anything that would fail (no preset, a CPU preset, mixed targets, no
    config.json, an engine option that cannot work, devices out of range), before any
    compile."""
    path = Path(path)
    resolved = []
    for entry in read_models_file(path):
        where = f"{path.name}: {entry.pinned_id}"
        if entry.is_adapter:
            continue  # its base's engine, whose plan counts the LoRA slots
        if entry.config is None:
            raise ValueError(f"{where}: config: planning needs a TPU/GPU preset for every "
                             "entry (the target and the memory budget come from it)")
        try:
            preset = load_preset(entry.config)
            plan_target(preset)
            model_dir = _model_dir(entry, path.resolve().parent)
            _, options = engine_settings(entry.config, preset.platform, entry.options())
            engine = engine_config_for(load_config(model_dir), options)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        resolved.append(PlannedEntry(entry, preset, model_dir, options,
                                     mesh_device_indices(engine)))
    first = resolved[0]
    for other in resolved[1:]:
        if (other.preset.platform, other.preset.accelerator) != (
                first.preset.platform, first.preset.accelerator):
            raise ValueError(
                f"{path.name}: {other.entry.pinned_id}: config: its preset is for "
                f"{other.preset.platform} {other.preset.accelerator}, but "
                f"{first.entry.pinned_id}'s is for {first.preset.platform} "
                f"{first.preset.accelerator}; one server runs on one kind of device")
    count = max(p.preset.devices for p in resolved)
    target = Target(first.preset.platform, first.preset.accelerator, count)
    for planned in resolved:
        outside = [d for d in planned.devices if d >= count]
        if outside:
            raise ValueError(f"{path.name}: {planned.entry.pinned_id}: devices {outside} are "
                             f"out of range: the presets declare at most {count} device(s), "
                             f"0 to {count - 1}")
    return target, resolved


def _model_dir(entry: ModelEntry, base: Path) -> Path:
    """The folder whose config.json describes the entry's model: its path, a shipped
    reference shape when the path is a bare name (resolved to `base/<name>`) that no folder
    holds, or a Hub id's config.json from the Hugging Face cache."""
    folder = Path(entry.path)
    if (folder / "config.json").is_file():
        return folder
    shipped = REFERENCE_MODELS / folder.name
    if folder.parent == base and (shipped / "config.json").is_file():
        return shipped
    if not folder.is_absolute():  # kept as written by the models file: a Hub id
        try:
            return resolve_model(entry.path, config_only=True)
        except ValueError as err:
            raise ValueError(f"path: {err}") from None
    raise ValueError(f"path: {str(folder)!r} has no config.json (a plan reads only the "
                     "model's config.json; a shipped reference shape may be named instead)")


def plan_models_file(path: str | Path, dtype: str | None = None, buckets: str = "ends",
                     progress: bool = True, verbose: bool = False) -> dict[str, Any]:
    """Plan every entry of the models file at `path` in file order on one target (see the
    module docstring), as a JSON-ready dict: the target, each engine's plan and the devices
    it uses, and per device the resident bytes and the largest program peak. `ValueError`s
    (bad entries) come before any compile; a plan that does not fit is a result."""
    target, resolved = resolve_entries(path)
    hbm = target.hbm_bytes()
    in_use = [0] * target.devices  # bytes per device index held by the engines loaded so far
    engines = []
    for planned in resolved:
        preset = dataclasses.replace(planned.preset, devices=target.devices)  # the host
        plan = build_plan(preset, planned.model_dir, dtype or planned.entry.dtype,
                          planned.options, buckets=buckets, verbose=verbose,
                          progress=progress, in_use_bytes=dict(enumerate(in_use)))
        resident = plan["weights_bytes_per_device"] + plan["kv_cache_bytes_per_device"]
        engines.append({
            "pinned_id": planned.entry.pinned_id, "preset": planned.preset.path.name,
            "model": plan["model"], "devices": list(planned.devices),
            "in_use_bytes_before": in_use[planned.devices[0]],  # what its cache was sized from
            "weights_bytes_per_device": plan["weights_bytes_per_device"],
            "kv_cache_bytes_per_device": plan["kv_cache_bytes_per_device"],
            "num_pages": plan["num_pages"], "resident_bytes_per_device": resident,
            "fits": plan["fits"], "plan": plan})
        for device in planned.devices:
            in_use[device] += resident
    devices = device_usage(engines, target.devices, hbm)
    fits, reason = _verdict(engines, devices, hbm)
    return {"models_file": Path(path).name, "platform": target.platform,
            "target": target.name, "devices": target.devices, "hbm_bytes_per_device": hbm,
            "fits": fits, "reason": reason, "engines": engines, "device_usage": devices}


def device_usage(engines: list[dict[str, Any]], num_devices: int,
                 hbm: int) -> list[dict[str, Any]]:
    """Per device index, once every engine is loaded: the engines on it, their resident bytes
    (weights + KV cache) and the largest program peak there, i.e. one engine's compiled
    program with every other engine's resident bytes beside it."""
    usage = []
    for device in range(num_devices):
        on = [e for e in engines if device in e["devices"]]
        resident = sum(e["resident_bytes_per_device"] for e in on)
        peak, program = 0, None
        for e in on:
            others = resident - e["resident_bytes_per_device"]
            for p in e["plan"]["programs"]:
                if p["compiled"] and others + p["peak_bytes"] > peak:
                    peak = others + p["peak_bytes"]
                    program = f"{e['pinned_id']} {p['name']} ({p['tokens']}, {p['seqs']})"
        usage.append({"device": device, "engines": [e["pinned_id"] for e in on],
                      "resident_bytes": resident, "peak_bytes": peak, "peak_program": program,
                      "fits": resident <= hbm and peak <= hbm})
    return usage


def _verdict(engines: list[dict[str, Any]], devices: list[dict[str, Any]],
             hbm: int) -> tuple[bool, str | None]:
    """(fits, the first reason it does not): an engine's own plan (with the engines before it
    resident), else a device once all are loaded."""
    for e in engines:
        if not e["fits"]:
            return False, f"{e['pinned_id']}: {e['plan']['reason']}"
    for d in devices:
        if not d["fits"]:
            return False, (f"device {d['device']}: {d['peak_program']} needs "
                           f"{d['peak_bytes'] / GIB:.2f} GiB of {hbm / GIB:.2f} with the other "
                           f"engines' weights and KV caches resident "
                           f"({d['resident_bytes'] / GIB:.2f} GiB in all)")
    return True, None


def format_models_plan(result: dict[str, Any], verbose: bool = False) -> str:
    """The verdict, one line per engine and per used device, then each engine's plan table."""

    def gib(value: int) -> str:
        return f"{value / GIB:.2f} GiB"

    verdict = "yes" if result["fits"] else f"NO ({result['reason']})"
    lines = [(f"{result['models_file']}: {len(result['engines'])} engine(s) on "
              f"{result['target']}, {result['devices']} device(s) of "
              f"{gib(result['hbm_bytes_per_device'])}"),
             f"  fits: {verdict}"]
    for e in result["engines"]:
        lines.append(f"  {e['pinned_id']} ({e['model']}, {e['preset']}) on devices "
                     f"{e['devices']}: weights {gib(e['weights_bytes_per_device'])}, KV cache "
                     f"{gib(e['kv_cache_bytes_per_device'])} ({e['num_pages']} pages) of "
                     f"{gib(result['hbm_bytes_per_device'] - e['in_use_bytes_before'])} free "
                     f"at load; fits: {'yes' if e['fits'] else 'NO'}")
    for d in result["device_usage"]:
        if d["engines"]:
            lines.append(f"  device {d['device']}: {', '.join(d['engines'])}: resident "
                         f"{gib(d['resident_bytes'])}, largest peak {gib(d['peak_bytes'])}"
                         + (f" ({d['peak_program']})" if d["peak_program"] else ""))
    for e in result["engines"]:
        lines += ["", f"{e['pinned_id']}:", format_plan(e["plan"], verbose)]
    return "\n".join(lines)


def run_models_plan(args: argparse.Namespace) -> int:
    """`jaxserve plan --models FILE` (`args`: models, json, buckets, verbose, dtype):
    prints the JSON or the table; 0 if everything fits, 1 if not."""
    import jax

    if not jax.config.jax_platforms:  # the host compiles; never probe for attached chips
        jax.config.update("jax_platforms", "cpu")
    result = plan_models_file(args.models, args.dtype, buckets=args.buckets,
                              progress=not args.json, verbose=args.verbose)
    print(json.dumps(result, indent=2) if args.json
          else format_models_plan(result, args.verbose))
    return 0 if result["fits"] else 1
