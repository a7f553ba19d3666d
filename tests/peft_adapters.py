"""PEFT adapters for the LoRA tests, written by `peft` itself on a tiny transformers model,
with A and B drawn large enough that every adapter changes the greedy tokens."""

from pathlib import Path

import peft
import torch
import transformers

# name -> LoraConfig fields: two ranks, two sets of target modules, both scalings
ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]),
    "everything": dict(r=8, lora_alpha=4, use_rslora=True,
                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                       "up_proj", "down_proj"]),
}
LORA_WEIGHT_STD = 0.2  # of A and B (peft would start B at zero: no change to the tokens)


def write_adapter(base: Path, out: Path, seed: int, **lora_config) -> None:
    """A PEFT folder of a random LoRA over the transformers model in `base`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(**lora_config))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(LORA_WEIGHT_STD * torch.randn_like(param))
    wrapped.save_pretrained(out)


def reference_tokens(base: Path, adapter: Path | None, prompts: list[list[int]],
                     max_tokens: int) -> list[list[int]]:
    """Greedy tokens of transformers (+ peft with the adapter in folder `adapter`)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                       max_new_tokens=max_tokens, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
            out.append(generated[0, len(prompt):].tolist())
    return out


def base_and_adapters(root: Path, prompt: list[int], max_tokens: int, seed: int = 0
                      ) -> tuple[Path, dict[str, Path], dict[str | None, list[int]]]:
    """A tiny Llama in `root / "base"` and every adapter of ADAPTERS beside it (seeds from
    `seed`), with transformers' (+ peft's) greedy tokens for `prompt` under each (None: the
    base alone)."""
    from tiny_models import build_model

    build_model("llama", root / "base")
    folders = {}
    for offset, (name, config) in enumerate(ADAPTERS.items()):
        folders[name] = root / name
        write_adapter(root / "base", folders[name], seed + offset, **config)
    expected = {name: reference_tokens(root / "base", folders.get(name), [prompt],
                                       max_tokens)[0] for name in (None, *ADAPTERS)}
    return root / "base", folders, expected
