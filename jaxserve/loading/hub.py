"""Model names as users give them: a local folder, or a Hugging Face Hub id.

`ORG/NAME` or `ORG/NAME@REVISION` (a branch, tag or commit) resolves through `huggingface_hub`,
as vLLM, SGLang and tpu-inference take hub ids: the files jaxserve reads are downloaded into
the local Hugging Face cache (`HF_HOME` / `HF_HUB_CACHE`), or, with `HF_HUB_OFFLINE=1`, read
from it without the network. A name that is neither a folder nor an id found either way is a
`ValueError` saying what was tried.
"""

from __future__ import annotations

import re
from pathlib import Path

# Hub repository ids: ORG/NAME, each part letters, digits, "-", "_", "." (not leading ".").
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# What loading a model reads: config, weights (safetensors only), tokenizer and templates.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def resolve_model(name: str | Path, config_only: bool = False) -> Path:
    """The folder of model `name`: the path itself when it is a folder, else the snapshot of
    Hub id `name` (`ORG/NAME[@REVISION]`) in the local Hugging Face cache, downloaded first
    unless offline. `config_only`: only config.json is needed (planning a model's shape)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    repo_id, _, revision = str(name).partition("@")
    if path.is_absolute() or not HUB_ID.fullmatch(repo_id):
        raise ValueError(f"model {str(name)!r} is not a folder (nor a Hugging Face Hub id "
                         "ORG/NAME[@REVISION])")
    import huggingface_hub
    from huggingface_hub import constants, errors

    offline = constants.HF_HUB_OFFLINE
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, revision=revision or None,
            allow_patterns=["config.json"] if config_only else MODEL_FILES)
    except errors.LocalEntryNotFoundError:
        where = ("the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else
                 "the Hugging Face Hub (unreachable) or the local cache")
        raise ValueError(f"model {str(name)!r} is not a folder, and {where} has no "
                         f"{repo_id}{'@' + revision if revision else ''}; "
                         f"cache: {constants.HF_HUB_CACHE}") from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError,
            errors.GatedRepoError) as err:
        raise ValueError(f"model {str(name)!r} is not a folder, and the Hugging Face Hub "
                         f"answered: {str(err).splitlines()[0]}") from None
    return Path(folder)
