"""Model names as users give them: a local folder, or a Hugging Face Hub id.

`ORG/NAME` or `ORG/NAME@REVISION` (a branch, tag or commit) resolves through `huggingface_hub`,
as vLLM, SGLang and tpu-inference take hub ids: the files jaxserve reads are downloaded into
the local Hugging Face cache (`HF_HOME` / `HF_HUB_CACHE`), or, with `HF_HUB_OFFLINE=1`, read
from it without the network. A name that is neither a folder nor an id found either way is a
`ValueError` saying what was tried. `hub_file` fetches one named file (a LoRA adapter's
config, checked before its weights are fetched).
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

# Hub repository ids: ORG/NAME, each part letters, digits, "-", "_", "." (not leading ".").
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# What loading a model reads: config, weights (safetensors only), tokenizer and templates.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def split_hub_id(name: str | Path) -> tuple[str, str | None] | None:
    """(repository id, revision or None) of `ORG/NAME[@REVISION]`, None if `name` is not one
    (an absolute path never is)."""
    repo_id, _, revision = str(name).partition("@")
    if Path(name).is_absolute() or not HUB_ID.fullmatch(repo_id):
        return None
    return repo_id, revision or None


def resolve_model(name: str | Path, config_only: bool = False) -> Path:
    """The folder of model `name`: the path itself when it is a folder, else the snapshot of
    Hub id `name` (`ORG/NAME[@REVISION]`) in the local Hugging Face cache, downloaded first
    unless offline. `config_only`: only config.json is needed (planning a model's shape)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    hub = split_hub_id(name)
    if hub is None:
        raise ValueError(f"model {str(name)!r} is not a folder (nor a Hugging Face Hub id "
                         "ORG/NAME[@REVISION])")
    import huggingface_hub

    with _hub_errors(str(name), *hub):
        folder = huggingface_hub.snapshot_download(
            hub[0], revision=hub[1],
            allow_patterns=["config.json"] if config_only else MODEL_FILES)
    return Path(folder)


def hub_file(name: str, filename: str, revision: str | None = None) -> Path:
    """File `filename` of Hub id `name` (`ORG/NAME[@REVISION]`) in the local Hugging Face
    cache, downloaded first unless offline; `revision` (a commit) overrides the id's.
    Nothing else of the repository is fetched. The file lies in the snapshot folder of the
    commit it came from (`path.parent.name` is that commit)."""
    hub = split_hub_id(name)
    if hub is None:
        raise ValueError(f"{name!r} is not a Hugging Face Hub id ORG/NAME[@REVISION]")
    import huggingface_hub

    with _hub_errors(name, hub[0], revision or hub[1]):
        return Path(huggingface_hub.hf_hub_download(hub[0], filename,
                                                    revision=revision or hub[1]))


@contextlib.contextmanager
def _hub_errors(name: str, repo_id: str, revision: str | None):
    """`huggingface_hub`'s errors as `ValueError`s saying what was tried."""
    from huggingface_hub import constants, errors

    try:
        yield
    except errors.LocalEntryNotFoundError:  # before its base class, EntryNotFoundError
        where = ("the local Hugging Face cache (HF_HUB_OFFLINE is set)"
                 if constants.HF_HUB_OFFLINE else
                 "the Hugging Face Hub (unreachable) or the local cache")
        raise ValueError(f"model {name!r} is not a folder, and {where} has no "
                         f"{repo_id}{'@' + revision if revision else ''}; "
                         f"cache: {constants.HF_HUB_CACHE}") from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError,
            errors.GatedRepoError) as err:
        raise ValueError(f"model {name!r} is not a folder, and the Hugging Face Hub "
                         f"answered: {str(err).splitlines()[0]}") from None
    except errors.EntryNotFoundError as err:  # a file the repository does not have
        raise ValueError(f"{name!r}: the Hugging Face Hub answered: "
                         f"{str(err).splitlines()[0]}") from None
