"""Which requests are the start-up sweep's (``k_sweep``): ids that carry a secret only the engine's own
processes and callers holding its API key know.

The sweep's requests change what the engine does (a step made only of them measures every k, and they
are left out of adaptive k's acceptance and out of capture), so a client must not be able to mark its
own requests as the sweep's: ``X-Request-Id`` and a body's ``request_id`` are any client's to set. The
plugin puts a random token in ``TOKEN_ENV`` in the process that starts vLLM (engine cores and workers
inherit it); ``POST /specrl/calibrate`` hands it to a caller that passes the routes' access rules
(the API key, or loopback without one); a sweep request's id carries ``PREFIX<token>-``."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable

PREFIX = "specrl-calibrate-"
TOKEN_ENV = "VLLM_SPECRL_CALIBRATION_TOKEN"

_marker: str | None = None


def ensure_token() -> str:
    """This deployment's token: inherited, or made here (the plugin calls it in every process, so the
    first process vLLM starts makes it for the others)."""
    return os.environ.setdefault(TOKEN_ENV, secrets.token_hex(12))


def token() -> str:
    """The token this process knows ("" where the plugin never ran)."""
    return os.environ.get(TOKEN_ENV, "")


def request_id(token_: str, batch: int, nonce: str) -> str:
    """The ``X-Request-Id`` of a sweep request of ``batch`` sequences."""
    return f"{PREFIX}{token_}-{batch}-{nonce}"


def is_calibration_request(request_id_: str) -> bool:
    """True for a request of the sweep: its id carries this deployment's token (vLLM builds the engine's
    request id around the header: ``cmpl-<header>-<i>``, then a random suffix)."""
    global _marker
    if _marker is None:
        current = token()
        if not current:
            return False
        _marker = f"{PREFIX}{current}-"
    return _marker in request_id_


def only_calibration(request_ids: Iterable[str]) -> bool:
    """At least one request, and every one the sweep's; stops at the first other one, so a step of
    real traffic pays for one id, however large its batch."""
    seen = False
    for rid in request_ids:
        if not is_calibration_request(rid):
            return False
        seen = True
    return seen
