"""Who may call which route: two keys, each sent as `Authorization: Bearer KEY`.

- The inference key (`--api-key`, or the environment's `JAXSERVE_API_KEY`, then vLLM's
  `VLLM_API_KEY`) guards the routes that serve requests or describe the deployment: `/v1/*`,
  the tokenizer routes, `/load`, `/get_server_info`, `/get_model_info`; and `/metrics` and
  `/get_load` with `--metrics-need-api-key`. Without one configured those routes are open.
- The admin key (`--admin-api-key` or `JAXSERVE_ADMIN_API_KEY`) guards the routes that
  change what is served: `/admin/reload` and the LoRA load and unload routes. Without one
  configured they are refused (403), never open; the inference key never opens them.

Keys are compared in constant time (`hmac.compare_digest`). A refusal is an `AuthError`,
which the app answers in OpenAI's error shape (401 `invalid_api_key`, 403
`admin_api_key_not_set`).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Mapping
from typing import Callable

from fastapi import Depends, Request

API_KEY_ENV = ("JAXSERVE_API_KEY", "VLLM_API_KEY")  # first set wins, after the flag
ADMIN_API_KEY_ENV = ("JAXSERVE_ADMIN_API_KEY",)

log = logging.getLogger("jaxserve.server")


class AuthError(Exception):
    """A request without the key its route needs."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    @property
    def error_type(self) -> str:
        return "authentication_error" if self.status == 401 else "permission_error"


def key_from(flag: str | None, names: tuple[str, ...], environ: Mapping[str, str]
             ) -> str | None:
    """The key a flag gives, else the first of the environment variables `names` that is
    set and not empty; None when neither gives one."""
    if flag:
        return flag
    return next((environ[name] for name in names if environ.get(name)), None)


def warn_if_open(host: str, api_key: str | None) -> None:
    """Log a warning when the server listens beyond this machine without an API key."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        loopback = False
    if api_key is None and not loopback:
        log.warning(
            "listening on %s without an API key: whoever reaches the port may use it (set "
            "JAXSERVE_API_KEY or VLLM_API_KEY)", host)


def has_key(request: Request, key: str) -> bool:
    """Whether `request` carries `Authorization: Bearer key`, compared in constant time."""
    given = request.headers.get("authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())


def check_api_key(key: str | None, request: Request) -> None:
    """Raise `AuthError` (401) unless `key` is None or the request carries it."""
    if key is not None and not has_key(request, key):
        raise AuthError(401, "invalid or missing API key (Authorization: Bearer ...)",
                        "invalid_api_key")


def check_admin_key(key: str | None, request: Request) -> None:
    """Raise `AuthError`: 403 when no admin key is configured, 401 when the request does
    not carry it."""
    if key is None:
        raise AuthError(403, "admin routes are disabled: start the server with "
                             "--admin-api-key or JAXSERVE_ADMIN_API_KEY to use them",
                        "admin_api_key_not_set")
    if not has_key(request, key):
        raise AuthError(401, "invalid or missing admin API key (Authorization: Bearer ...)",
                        "invalid_api_key")


def api_key_dependency(key: Callable[[], str | None]):
    """A FastAPI dependency requiring the inference key that `key()` returns now."""
    async def require_api_key(request: Request) -> None:
        check_api_key(key(), request)
    return Depends(require_api_key)


def admin_key_dependency(key: Callable[[], str | None]):
    """A FastAPI dependency requiring the admin key that `key()` returns now."""
    async def require_admin_key(request: Request) -> None:
        check_admin_key(key(), request)
    return Depends(require_admin_key)
