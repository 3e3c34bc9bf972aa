"""Client-side check of a ``/specrl/*`` response: a server without the package's routes says why.

``vllm serve`` answers 404 on every ``/specrl/*`` path when the ``specrl_http`` endpoint plugin did not
load, most often because ``VLLM_PLUGINS`` was set to ``specrl`` alone (once set, it is an allowlist for
every plugin group). A bare ``404 Not Found`` minutes into a run does not say that; this does.
"""

from __future__ import annotations

import requests

MISSING_ROUTES_HINT = ("the server has no /specrl routes: its specrl_http endpoint plugin did not load. "
                       "Start `vllm serve` with VLLM_PLUGINS unset or naming both plugins "
                       "(VLLM_PLUGINS=specrl,specrl_http)")


API_KEY_ENV = "VLLM_SPECRL_API_KEY"
KEY_REFUSED_HINT = (f"the engine wants its API key: pass api_key= (EngineClient, DraftTrainerProcess.start), "
                    f"--api-key (train-draft), or set {API_KEY_ENV}")


class SpecRLRoutesMissing(RuntimeError):
    """The engine serves no ``/specrl/*`` routes (the endpoint plugin is not loaded)."""


class EngineKeyRefused(PermissionError):
    """The engine refused the client's API key (or its absence): a setting to fix, never retried."""


def raise_if_missing(response: requests.Response) -> None:
    """Raise ``SpecRLRoutesMissing`` for a 404 on a ``/specrl/`` path (the package's own routes answer
    refusals with 400, 401, 403 or 503, never 404); any other response passes."""
    if response.status_code == 404 and "/specrl/" in (response.url or ""):
        raise SpecRLRoutesMissing(f"{response.url}: HTTP 404; {MISSING_ROUTES_HINT}")
    if response.status_code == 401 and "/specrl/" in (response.url or ""):
        raise EngineKeyRefused(f"{response.url}: HTTP 401; {KEY_REFUSED_HINT}")


def raise_for_status(response: requests.Response) -> None:
    """``response.raise_for_status()``, except that missing ``/specrl`` routes are named as such."""
    raise_if_missing(response)
    response.raise_for_status()
