"""Errors that name what was wrong, for the Python API and the HTTP server alike."""

from __future__ import annotations

import importlib.util


class InvalidRequestError(ValueError):
    """A request value that cannot be served. `field` names it (the OpenAI error body's
    `param`: "temperature", "prompt", ...); the message says why."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field


class MissingExtraError(ValueError):
    """An optional package a command needs is not installed; the message names the extra
    that installs it (the command line prints it as one line and exits 2)."""


def require_extra(modules: list[str], extra: str, purpose: str) -> None:
    """Raise `MissingExtraError` unless every one of `modules` can be imported."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(f"{purpose} needs {', '.join(missing)}: "
                                f"pip install 'jaxserve[{extra}]'")
