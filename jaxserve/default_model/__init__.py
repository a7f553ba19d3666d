"""The small model that ships with jaxserve, used when no model is given.

A Hugging Face model folder (config.json, model.safetensors, tokenizer files) beside this file;
see README.md in it for what it is and how `jaxserve.training.train_default_model` made it.
"""

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL_NAME = "austen-3.4m"  # what the server calls it when no --model is given
