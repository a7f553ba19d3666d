"""The models file: which models and versions one server runs, and how traffic splits.

    [[models]]
    name = "austen"              # the id clients send as "model"
    version = "2"                # optional, default "1"; the pinned id is "austen@2"
    path = "models/austen-v2"    # Hugging Face folder, Hub id or jaxserve orbax checkpoint
    weight = 10                  # share of "austen" traffic among its versions (default 100)
    config = "v5e-4"             # optional preset for this engine: a shipped name or a file
    devices = [0, 1, 2, 3]       # optional: local devices this engine uses
    max_num_seqs = 32            # optional engine options, as in presets and `LLM(...)`
    fallback = "austen@1"        # optional: who answers when this one cannot

    [[models]]                   # a version that is another one plus a LoRA adapter
    name = "austen"
    version = "3"
    base = "austen@2"            # the pinned id of a model entry of this file (enable_lora)
    lora_path = "adapters/v3"    # a PEFT folder
    weight = 5

An adapter version shares its base's engine, queue and device memory: it has no `path`,
preset, dtype or engine options of its own, and every request routed to it runs with its
adapter (vLLM's LoRA batching, `jaxserve.lora`). So a canary of a fine-tune costs one adapter
slot, not a second copy of the model.

Conventions follow TF Serving's model repository (a name, numbered versions, one served id
per version) and KServe's canary split (a traffic weight per version). Relative `path` and
`config` are resolved against the folder of the models file, so a file and the models beside
it move together; a value with nothing beside the file that names a shipped preset (`config`)
or a Hub id (`path`) is kept as it is.

Everything that can be checked without loading a model is checked here, and the first
problem is a `ValueError` naming the entry and the field: unknown fields and engine options,
a duplicate pinned id, a fallback to an unknown model, a fallback cycle, devices out of
range, a name whose weights are all 0.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from jaxserve.config.engine import EngineConfig
from jaxserve.loading.hub import HUB_ID
from jaxserve.presets import read_toml, shipped_presets

ENGINE_OPTIONS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
# entry fields that are not engine options (`devices` is both: it goes to the engine)
ENTRY_FIELDS = frozenset({"name", "version", "path", "weight", "config", "fallback", "dtype",
                          "max_waiting_requests", "base", "lora_path"})
ADAPTER_FIELDS = frozenset({"name", "version", "weight", "fallback", "base", "lora_path"})
DEFAULT_WEIGHT = 100


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One served model version: an engine of its own (KV pool, queue, programs)."""

    name: str
    path: str
    version: str = "1"
    weight: float = DEFAULT_WEIGHT
    config: str | None = None
    dtype: str | None = None
    fallback: str | None = None  # a name (any of its versions, by weight) or a pinned id
    max_waiting_requests: int | None = None  # None: the server's --max-waiting-requests
    engine_options: tuple[tuple[str, Any], ...] = ()  # sorted (option, value) pairs
    aliases: tuple[str, ...] = ()  # other names that reach this entry (--served-model-name)
    base: str | None = None  # an adapter version: its base's pinned id, and the adapter's
    lora_path: str | None = None  # PEFT folder (`path` is then empty)

    @property
    def pinned_id(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def is_adapter(self) -> bool:
        return self.base is not None

    def options(self) -> dict[str, Any]:
        return dict(self.engine_options)

    def engine_definition(self) -> tuple:
        """What the engine is built from: entries that agree on it can keep one running
        engine across a reload (weight, fallback and queue limit change without a reload).
        An adapter version's is its base and folder (it also reloads when its base does)."""
        if self.is_adapter:
            return (self.base, self.lora_path)
        return (self.path, self.config, self.dtype, self.engine_options)


def read_models_file(path: str | Path, num_devices: int | None = None) -> list[ModelEntry]:
    """The entries of the models file at `path`, checked (`ValueError` naming the problem).
    `num_devices`: how many local devices `devices` may index (None: not checked)."""
    path = Path(path)
    data = read_toml(path, "models file")
    return parse_models(data, path.name, path.resolve().parent, num_devices)


def parse_models(data: dict[str, Any], source: str, base: Path,
                 num_devices: int | None = None) -> list[ModelEntry]:
    """Entries from a models file's parsed TOML; `source` names the file in errors, `base`
    is the folder relative paths start from."""
    unknown = sorted(set(data) - {"models"})
    if unknown:
        raise ValueError(f"{source}: unknown top-level key(s) {unknown}; the file holds "
                         "[[models]] tables")
    tables = data.get("models")
    if not isinstance(tables, list) or not tables:
        raise ValueError(f"{source}: no [[models]] entries")
    entries = [_entry(table, f"{source}: models[{i}]", base, num_devices)
               for i, table in enumerate(tables)]
    check_entries(entries, source)
    return entries


def check_entries(entries: list[ModelEntry], source: str) -> None:
    """The checks across entries: unique pinned ids, routable names, fallbacks that exist
    and do not loop."""
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        if entry.pinned_id in seen:
            raise ValueError(f"{source}: models[{i}] repeats the pinned id {entry.pinned_id!r} "
                             f"of models[{seen[entry.pinned_id]}] (same name and version)")
        seen[entry.pinned_id] = i
    models = {e.pinned_id for e in entries if not e.is_adapter}
    for i, entry in enumerate(entries):
        if entry.is_adapter and entry.base not in models:
            raise ValueError(f"{source}: models[{i}] ({entry.pinned_id}).base {entry.base!r} "
                             f"is not the pinned id of a model entry (one with a path) in "
                             f"this file; model entries: {sorted(models)}")
    by_name: dict[str, list[ModelEntry]] = {}
    for entry in entries:
        by_name.setdefault(entry.name, []).append(entry)
    for name, versions in by_name.items():
        if not any(v.weight > 0 for v in versions):
            raise ValueError(f"{source}: every version of {name!r} has weight 0, so requests "
                             f"for {name!r} could go nowhere")
    for i, entry in enumerate(entries):
        if entry.fallback is not None and not _targets(entry.fallback, by_name, seen):
            raise ValueError(f"{source}: models[{i}] ({entry.pinned_id}): fallback "
                             f"{entry.fallback!r} is not a model name or pinned id in this "
                             f"file")
    _check_no_cycle(entries, by_name, seen, source)


def _targets(fallback: str, by_name: dict[str, list[ModelEntry]],
             pinned: dict[str, int]) -> list[str]:
    """Pinned ids a fallback may reach: the pinned id itself, or every version of a name."""
    if fallback in pinned:
        return [fallback]
    return [v.pinned_id for v in by_name.get(fallback, [])]


def _check_no_cycle(entries, by_name, pinned, source: str) -> None:
    """A fallback chain must end: a cycle (a -> b -> a, or a -> its own name) is an error."""
    edges = {e.pinned_id: _targets(e.fallback, by_name, pinned) if e.fallback else []
             for e in entries}
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in edges[node]:
            if state.get(nxt) == "open":
                loop = " -> ".join(path[path.index(nxt):] + [nxt])
                raise ValueError(f"{source}: fallback cycle {loop}")
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for entry in entries:
        if entry.pinned_id not in state:
            visit(entry.pinned_id, [entry.pinned_id])


def _entry(table: Any, where: str, base: Path, num_devices: int | None) -> ModelEntry:
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table")
    unknown = sorted(set(table) - ENTRY_FIELDS - ENGINE_OPTIONS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; entry fields: "
                         f"{sorted(ENTRY_FIELDS)}, engine options: {sorted(ENGINE_OPTIONS)}")
    name = _identifier(table.get("name"), f"{where}.name")
    version = table.get("version", "1")
    if isinstance(version, int) and not isinstance(version, bool):
        version = str(version)
    version = _identifier(version, f"{where}.version")
    where = f"{where} ({name}@{version})"
    if "base" in table or "lora_path" in table:
        return _adapter_entry(table, where, name, version, base)
    path = table.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}.path: a model folder is required")
    weight = _weight(table, where)
    config = table.get("config")
    if config is not None and not isinstance(config, str):
        raise ValueError(f"{where}.config must be a preset's name or file path")
    fallback = _fallback(table, where, name, version)
    dtype = table.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        raise ValueError(f"{where}.dtype must be a string")
    waiting = table.get("max_waiting_requests")
    if waiting is not None and (isinstance(waiting, bool) or not isinstance(waiting, int)
                                or waiting < 1):
        raise ValueError(f"{where}.max_waiting_requests must be a positive integer")
    options = {k: tuple(v) if isinstance(v, list) else v
               for k, v in table.items() if k in ENGINE_OPTIONS}
    if "devices" in options:
        _check_devices(options["devices"], f"{where}.devices", num_devices)
    return ModelEntry(name=name, version=version, path=_resolve(path, base),
                      weight=weight,
                      config=_resolve(config, base, shipped_presets()) if config else None,
                      dtype=dtype, fallback=fallback, max_waiting_requests=waiting,
                      engine_options=tuple(sorted(options.items())))


def _adapter_entry(table: dict, where: str, name: str, version: str, folder: Path
                   ) -> ModelEntry:
    """An entry with `base` and `lora_path`: a model entry's engine plus a LoRA adapter."""
    others = sorted(set(table) - ADAPTER_FIELDS)
    if others:
        raise ValueError(f"{where}: {others} cannot be set on an adapter version (one with "
                         f"`base` and `lora_path`): it runs on its base's engine; its "
                         f"fields: {sorted(ADAPTER_FIELDS)}")
    for field in ("base", "lora_path"):
        if not isinstance(table.get(field), str) or not table[field]:
            raise ValueError(f"{where}.{field}: an adapter version needs both `base` (a "
                             f"pinned id) and `lora_path` (a PEFT folder)")
    return ModelEntry(name=name, version=version, path="", weight=_weight(table, where),
                      fallback=_fallback(table, where, name, version), base=table["base"],
                      lora_path=_resolve(table["lora_path"], folder))


def _weight(table: dict, where: str) -> float:
    weight = table.get("weight", DEFAULT_WEIGHT)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
        raise ValueError(f"{where}.weight must be a number >= 0, got {weight!r}")
    return weight


def _fallback(table: dict, where: str, name: str, version: str) -> str | None:
    fallback = table.get("fallback")
    if fallback is not None and (not isinstance(fallback, str) or not fallback):
        raise ValueError(f"{where}.fallback must be a model name or pinned id")
    if fallback in (name, f"{name}@{version}"):
        raise ValueError(f"{where}.fallback names the entry itself ({fallback!r})")
    return fallback


def _identifier(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where} must be a non-empty string")
    if "@" in value or any(c.isspace() for c in value):
        raise ValueError(f"{where} {value!r} may not contain '@' or spaces ('@' separates "
                         "the name from the version in pinned ids)")
    return value


def _check_devices(devices: Any, where: str, num_devices: int | None) -> None:
    if not isinstance(devices, tuple) or not devices or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in devices):
        raise ValueError(f"{where} must be a non-empty list of device indices")
    if len(set(devices)) != len(devices):
        raise ValueError(f"{where} lists a device twice: {list(devices)}")
    limit = num_devices
    bad = [d for d in devices if d < 0 or (limit is not None and d >= limit)]
    if bad:
        count = f"this host has {limit} device(s), 0 to {limit - 1}" if limit else "negative"
        raise ValueError(f"{where}: devices {bad} are out of range ({count})")


def _resolve(value: str, base: Path, names=()) -> str:
    """`value` against the models file's folder, unless nothing is there and it is one of
    `names` (shipped presets) or a Hub id."""
    candidate = Path(value).expanduser()
    if candidate.is_absolute():
        return str(candidate)
    beside = base / candidate
    if not beside.exists() and (value in names or HUB_ID.fullmatch(value.partition("@")[0])):
        return value
    return str(beside)
