"""The small model that ships with jaxserve, used when no model is given.

A Hugging Face model folder (config.json, model.safetensors, tokenizer files) beside this file;
see README.md in it for what it is and how `jaxserve.training.train_default_model` made it.
"""

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent
# its EAGLE-3 head (`jaxserve.training.train_eagle3_head`): what `speculative_config`
# {"method": "eagle3"} without a "model" drafts with for this model
DEFAULT_EAGLE3_DIR = DEFAULT_MODEL_DIR / "eagle3"
DEFAULT_MODEL_NAME = "austen-3.4m"  # what the server calls it when no --model is given
