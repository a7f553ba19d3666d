"""What `jaxserve serve` makes of its server flags' values, each checked before the socket
opens (a `ValueError` naming the flag is exit 2): the chat template, the Hub revision and
download folder, the TLS files, CORS, and the URL the ready line prints
(`jaxserve.server.state.ready_line`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def read_chat_template(value: str | None) -> str | None:
    """`--chat-template` as vLLM reads it: the text of a file, else the value itself when it
    looks like a template (holds "{" or a newline); a value that looks like a path to a
    missing file is an error, not a template that prints the path."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a template (a "
                     "template holds {{ }} or {% %})")


def check_generation_config(value: str) -> None:
    """`--generation-config` is auto, vllm or a folder."""
    if value not in ("auto", "vllm") and not Path(value).expanduser().is_dir():
        raise ValueError(f"--generation-config {value!r}: expected auto, vllm or a folder "
                         "holding generation_config.json")


def with_revision(model: str, revision: str | None) -> str:
    """`--model` with `--revision` folded in (`ORG/NAME@REVISION`, what the Hub loader
    takes); a local folder or a second revision is an error."""
    if revision is None:
        return model
    if Path(model).expanduser().is_dir():
        raise ValueError(f"--revision names a Hub revision; --model {model!r} is a local "
                         "folder")
    if "@" in model:
        raise ValueError(f"--revision {revision!r} and --model {model!r} both name a revision")
    return f"{model}@{revision}"


def use_download_dir(folder: str) -> None:
    """`--download-dir`: Hub models are downloaded into, and read from, `folder` (the
    Hugging Face cache's HF_HUB_CACHE, set before the Hub library reads it)."""
    os.environ["HF_HUB_CACHE"] = str(Path(folder).expanduser())
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:  # already imported: it read the variable at import
        constants.HF_HUB_CACHE = os.environ["HF_HUB_CACHE"]


def check_ssl_files(keyfile: str | None, certfile: str | None) -> bool:
    """Whether to serve HTTPS: `--ssl-keyfile` and `--ssl-certfile` together, both files."""
    if (keyfile is None) != (certfile is None):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{flag} {path!r} is not a file")
    return keyfile is not None


def cors_settings(args: argparse.Namespace) -> dict | None:
    """Starlette's `CORSMiddleware` keywords from vLLM's CORS flags; None without
    `--allowed-origins` (no cross-origin access)."""
    if not args.allowed_origins:
        return None
    return {"allow_origins": list(args.allowed_origins),
            "allow_credentials": args.allow_credentials,
            "allow_methods": list(args.allowed_methods),
            "allow_headers": list(args.allowed_headers)}


def server_url(host: str, port: int, root_path: str | None, https: bool) -> str:
    """The URL a client on this machine connects to (a wildcard address is reached on the
    loopback one)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    host = f"[{host}]" if ":" in host else host
    return f"{'https' if https else 'http'}://{host}:{port}{(root_path or '').rstrip('/')}"

