"""A PEFT LoRA folder read into the engine's layout, checked against the base model.

A PEFT folder holds `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`,
`target_modules`, ...) and `adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight`, A `[r, in]`
and B `[out, r]` as `torch.nn.Linear` stores them. The adapter adds `(x A^T) B^T * scaling`
to the module's output, `scaling` = lora_alpha / r (lora_alpha / sqrt(r) with rslora).

Here every one of the seven projections a Llama-family layer has gets a pair of stacks,
`A [L, in, R]` and `B [L, R, out]` with `R = max_lora_rank`: ranks are zero-padded, layers
and modules the adapter leaves alone are zeros, and the scaling is folded into B. So every
adapter has the same shapes, and one compiled program serves any of them. `in`/`out` are the
module's flattened sizes (q: hidden -> heads x head_dim, o: heads x head_dim -> hidden, ...).

What PEFT can write but this engine does not run is refused by name (`ValueError`):
`modules_to_save`, `use_dora`, a `bias` other than "none", `alpha_pattern`, LoRA on the
embedding or the language-model head, a rank above `max_lora_rank`.

An adapter shares every step with other requests, so what could spill into their rows is
refused too: a non-finite number anywhere in the config (`lora_alpha: NaN`, `1e400`), a
non-finite tensor, a scaling that overflows float32, a tensor that is not 2-d, rank 0, a
malformed safetensors header. The file's header (names, shapes, ranks) is checked before
any tensor is read, so an oversized adapter costs no memory. A Hub id's config is fetched
and checked before its weights, and only `adapter_model.safetensors` is fetched.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

import sharding
from jaxserve.loading.hub import hub_file, split_hub_id
from jaxserve.loading.weights import mapped_tensors, safetensors_header
from jaxserve.model.config import ModelConfig
from jaxserve.model.lora import LORA_MODULES, module_sizes

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                     r"(\w+)\.lora_([AB])\.weight$")


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """An adapter ready for a device slot: `stacks[module] = (A [L, in, R], B [L, R, out])`
    float32, the scaling folded into B; `rank` as trained (before padding)."""

    path: str
    rank: int
    stacks: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.stacks.values())


def adapter_folder(path: str | Path) -> Path:
    """The PEFT folder `path` names: a folder, or a Hub id (ORG/NAME[@REVISION], downloaded
    unless offline; `hub_adapter_folder`), as vLLM takes adapters."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    if split_hub_id(path) is None:
        raise ValueError(f"lora_path {str(path)!r} is not a folder (nor a Hugging Face Hub "
                         "id ORG/NAME[@REVISION])")
    return hub_adapter_folder(str(path))


def hub_adapter_folder(name: str) -> Path:
    """The snapshot folder of Hub id `name` holding its adapter: `adapter_config.json`
    fetched and checked first, then `adapter_model.safetensors` alone, of the same commit;
    nothing else of the repository is fetched."""
    try:
        config = hub_file(name, CONFIG_FILE)
        read_adapter_config(config.parent)
        hub_file(name, WEIGHTS_FILE, revision=config.parent.name)  # the config's commit
    except ValueError as err:
        raise ValueError(f"lora_path: {err}") from None
    return config.parent


def read_adapter_config(folder: Path) -> dict:
    """`adapter_config.json`, checked for what this engine runs (`ValueError` naming the
    field otherwise)."""
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"lora_path {str(folder)!r} has no {CONFIG_FILE} (not a PEFT "
                         "adapter folder)")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{CONFIG_FILE} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_FILE} is not a JSON object")
    for field, value in _non_finite(config):
        raise ValueError(f"{CONFIG_FILE}: {field} must be a finite number, got {value!r}")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{CONFIG_FILE}: peft_type is {config['peft_type']!r}; only LORA "
                         "adapters are served")
    refusals = {"modules_to_save": "extra trained copies of whole modules are not served",
                "use_dora": "DoRA adapters are not served",
                "alpha_pattern": "per-module lora_alpha is not served",
                "fan_in_fan_out": "Conv1D-style weights (GPT-2) are not served"}
    for field, why in refusals.items():
        if config.get(field):
            raise ValueError(f"{CONFIG_FILE}: {field} is set; {why}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{CONFIG_FILE}: bias is {config['bias']!r}; only adapters without "
                         "trained biases ('none') are served")
    for field, kinds in (("r", int), ("lora_alpha", (int, float))):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
            raise ValueError(f"{CONFIG_FILE}: {field} must be a positive "
                             f"{'integer' if kinds is int else 'number'}, got {value!r}")
    return config


def _non_finite(value, where: str = ""):
    """(field path, value) of every NaN or infinite number in a parsed JSON value (Python's
    JSON reader takes NaN and Infinity, and reads 1e400 as inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _non_finite(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _non_finite(item, f"{where}[{i}]")


def load_adapter(path: str | Path, cfg: ModelConfig, max_lora_rank: int,
                 tensor_parallel_size: int = 1) -> LoRAAdapter:
    """The adapter in PEFT folder `path`, for a base model of config `cfg` as stored on the
    mesh (kv heads repeated when tensor parallelism exceeds them: the adapter's k/v columns
    are repeated the same way), padded to rank `max_lora_rank`."""
    folder = adapter_folder(path)
    config = read_adapter_config(folder)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"lora_path {str(folder)!r} has no {WEIGHTS_FILE}")
    plan = _planned_pairs(weights, cfg, max_lora_rank, tensor_parallel_size)
    arrays = {}
    for name, tensor in mapped_tensors(weights):
        arrays[name] = np.asarray(tensor, np.float32)  # [r, in] or [out, r]
        if not np.isfinite(arrays[name]).all():
            raise ValueError(f"{WEIGHTS_FILE}: tensor {name!r} holds non-finite values "
                             "(NaN or inf)")
    sizes = module_sizes(cfg)
    stacks = {m: (np.zeros((cfg.num_layers, sizes[m][0], max_lora_rank), np.float32),
                  np.zeros((cfg.num_layers, max_lora_rank, sizes[m][1]), np.float32))
              for m in LORA_MODULES}
    for (layer, module), (name_a, name_b, r, repeats) in plan.items():
        a, b = arrays[name_a], arrays[name_b]  # [r, in], [out / repeats, r]
        if repeats > 1:  # each kv head's rows repeated as the base model's heads are
            b = np.repeat(b.reshape(-1, cfg.head_dim, r), repeats, axis=0).reshape(-1, r)
        scale = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
        stacks[module][0][layer, :, :r] = a.T
        with np.errstate(over="ignore"):
            stacks[module][1][layer, :r, :] = b.T * scale
        if not np.isfinite(stacks[module][1][layer]).all():
            raise ValueError(f"{CONFIG_FILE}: lora_alpha {config['lora_alpha']!r} scales "
                             f"{name_b!r} beyond float32's range")
    return LoRAAdapter(str(path), max(r for _, _, r, _ in plan.values()), stacks)


def _planned_pairs(weights: Path, cfg: ModelConfig, max_lora_rank: int,
                   tensor_parallel_size: int) -> dict[tuple[int, str], tuple]:
    """`{(layer, module): (lora_A name, lora_B name, rank, kv repeats)}` from the
    safetensors header alone, every name, shape and rank checked (`ValueError` naming the
    tensor), before any tensor is read."""
    try:
        header = safetensors_header(weights)[1]
    except ValueError as err:
        raise ValueError(f"{WEIGHTS_FILE}: {err}") from None
    sizes = module_sizes(cfg)
    found: dict[tuple[int, str], dict[str, tuple[str, tuple[int, ...]]]] = {}
    for name, entry in header.items():
        if not _valid_entry(entry):
            raise ValueError(f"{WEIGHTS_FILE}: malformed safetensors header: tensor {name!r} "
                             "needs a dtype, a shape and two data_offsets")
        shape = entry["shape"]
        match = _TENSOR.match(name)
        if match is None:
            raise ValueError(f"{WEIGHTS_FILE}: tensor {name!r} is not a LoRA weight of a "
                             f"decoder layer's projection ({', '.join(LORA_MODULES)})")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in sizes:
            raise ValueError(f"{WEIGHTS_FILE}: {name!r} adapts {module!r}; adapters may "
                             f"target {', '.join(LORA_MODULES)}")
        if not 0 <= layer < cfg.num_layers:
            raise ValueError(f"{WEIGHTS_FILE}: {name!r} names layer {layer}; the base model "
                             f"has {cfg.num_layers}")
        if len(shape) != 2:
            raise ValueError(f"{WEIGHTS_FILE}: tensor {name!r} has shape {shape}; a LoRA "
                             "weight is a matrix (2-d)")
        found.setdefault((layer, module), {})[which] = (name, tuple(shape))
    if not found:
        raise ValueError(f"{WEIGHTS_FILE} holds no LoRA weights")
    plan = {}
    for (layer, module), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{WEIGHTS_FILE}: layer {layer}'s {module} has lora_"
                             f"{''.join(pair)} without its pair")
        (name_a, a), (name_b, b) = pair["A"], pair["B"]  # [r, in], [out, r]
        r, (size_in, size_out) = a[0], sizes[module]
        if r == 0:
            raise ValueError(f"{WEIGHTS_FILE}: {name_a!r} has rank 0")
        if r > max_lora_rank:
            raise ValueError(f"the adapter's rank {r} (layer {layer}'s {module}) exceeds "
                             f"max_lora_rank={max_lora_rank}")
        repeats = (_kv_repeats(b[0], cfg, tensor_parallel_size)
                   if module in ("k_proj", "v_proj") else 1)
        if a != (r, size_in) or b[1] != r or b[0] * repeats != size_out:
            raise ValueError(
                f"{WEIGHTS_FILE}: layer {layer}'s {module} has lora_A {list(a)} and "
                f"lora_B {list(b)}; the base model needs [r, {size_in}] and "
                f"[{size_out}, r] (was the adapter trained on another model?)")
        plan[(layer, module)] = (name_a, name_b, r, repeats)
    return plan


def _valid_entry(entry) -> bool:
    """Whether a safetensors header entry has a dtype name, a shape of sizes and a pair of
    data offsets (what reading it relies on)."""
    def sizes(value, length=None) -> bool:
        return isinstance(value, list) and length in (None, len(value)) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)

    return (isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
            and sizes(entry.get("shape")) and sizes(entry.get("data_offsets"), 2))


def _kv_repeats(rows: int, cfg: ModelConfig, tensor_parallel_size: int) -> int:
    """How many times each kv head of a k/v lora_B of `rows` rows (`[Hkv * D, r]`, the
    checkpoint's heads) is repeated to match the base model as stored on the mesh
    (`sharding.kv_head_repeats`); 1 when it is not a whole number of heads or already has
    the stored count."""
    heads, rest = divmod(rows, cfg.head_dim)
    if rest or heads == 0 or heads == cfg.num_kv_heads or cfg.num_heads % heads:
        return 1
    repeats = sharding.kv_head_repeats(heads, cfg.num_heads, tensor_parallel_size)
    return repeats if heads * repeats == cfg.num_kv_heads else 1
