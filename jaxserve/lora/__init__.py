"""LoRA adapters served beside their base model (vLLM's interface).

- `request`: `LoRARequest(lora_name, lora_int_id, lora_path)`, what a prompt names;
- `adapter`: a PEFT folder read and checked into per-module stacks padded to the engine's
  `max_lora_rank` (plain numpy: host memory holds every loaded adapter);
- `slots`: which adapter each of the `max_loras` device slots holds, in use by whom, and
  which to load next (least recently used first); the scheduler asks it at admission;
- `registry`: the adapters an engine has read, by name (the server loads and unloads them),
  at most `max_cpu_loras`, one load per name at a time;
- `runtime`: what clients may load while the server runs, when the operator allows it;
- `stacks`: the slots' arrays on the device, placed like their base projections.

The arithmetic on the device is `jaxserve.model.lora`; the engine (`Runner.load_lora`)
writes an adapter into its slot with one compiled program, so any mix of adapters runs on
the programs compiled at warm-up.
"""

from jaxserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
