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
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

import sharding
from jaxserve.loading.hub import resolve_model
from jaxserve.loading.weights import mapped_tensors
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
    """The PEFT folder `path` names: a folder, or a Hub id's snapshot (ORG/NAME[@REVISION],
    downloaded unless offline), as vLLM takes adapters."""
    try:
        return resolve_model(path)
    except ValueError as err:
        raise ValueError(f"lora_path: {err}") from None


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
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{CONFIG_FILE}: {field} must be a positive number, got "
                             f"{value!r}")
    return config


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
    scale_of = {r: config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
                for r in range(1, max_lora_rank + 1)}
    sizes = module_sizes(cfg)
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, tensor in mapped_tensors(weights):
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
        found.setdefault((layer, module), {})[which] = np.asarray(tensor, np.float32)
    if not found:
        raise ValueError(f"{WEIGHTS_FILE} holds no LoRA weights")
    stacks = {m: (np.zeros((cfg.num_layers, sizes[m][0], max_lora_rank), np.float32),
                  np.zeros((cfg.num_layers, max_lora_rank, sizes[m][1]), np.float32))
              for m in LORA_MODULES}
    rank = 0
    for (layer, module), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{WEIGHTS_FILE}: layer {layer}'s {module} has lora_"
                             f"{''.join(pair)} without its pair")
        a, b = pair["A"], pair["B"]  # [r, in], [out, r]
        if module in ("k_proj", "v_proj"):
            b = _repeated_kv_heads(b, cfg, tensor_parallel_size)
        r, (size_in, size_out) = a.shape[0], sizes[module]
        if a.shape != (r, size_in) or b.shape != (size_out, r):
            raise ValueError(
                f"{WEIGHTS_FILE}: layer {layer}'s {module} has lora_A {list(a.shape)} and "
                f"lora_B {list(b.shape)}; the base model needs [r, {size_in}] and "
                f"[{size_out}, r] (was the adapter trained on another model?)")
        if r > max_lora_rank:
            raise ValueError(f"the adapter's rank {r} (layer {layer}'s {module}) exceeds "
                             f"max_lora_rank={max_lora_rank}")
        stacks[module][0][layer, :, :r] = a.T
        stacks[module][1][layer, :r, :] = b.T * scale_of[r]
        rank = max(rank, r)
    return LoRAAdapter(str(path), rank, stacks)


def _repeated_kv_heads(b: np.ndarray, cfg: ModelConfig, tensor_parallel_size: int
                       ) -> np.ndarray:
    """A k/v lora_B `[Hkv * D, r]` of the checkpoint's kv heads, each repeated as the base
    model's are on the mesh (`sharding.kv_head_repeats`); unchanged when it is not a whole
    number of heads or already has the stored count."""
    heads, rest = divmod(b.shape[0], cfg.head_dim)
    if rest or heads == cfg.num_kv_heads or cfg.num_heads % heads:
        return b
    repeats = sharding.kv_head_repeats(heads, cfg.num_heads, tensor_parallel_size)
    if heads * repeats != cfg.num_kv_heads:
        return b
    per_head = b.reshape(heads, cfg.head_dim, b.shape[1])
    return np.repeat(per_head, repeats, axis=0).reshape(-1, b.shape[1])
