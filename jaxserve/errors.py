"""Errors that name what was wrong, for the Python API and the HTTP server alike."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request value that cannot be served. `field` names it (the OpenAI error body's
    `param`: "temperature", "prompt", ...); the message says why."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field
