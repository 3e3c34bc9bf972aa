"""``FleetClient``: one weight update across N independent ``vllm serve`` replicas, all or nothing.

    fleet = FleetClient(["http://10.0.0.1:8000", "http://10.0.0.2:8000"], api_key=KEY)
    fleet.update_policy(model.named_parameters(), version=step)
    fleet.quarantined      # replicas left out after failing to apply, with the reason

RL frameworks run many rollout replicas and must never sample one step from two
policy versions by accident. The update runs in phases on every replica in
parallel: stage (upload, validated), prepare (every worker of every replica
holds the whole update), then commit. Any refusal before the commit aborts the
update everywhere: nothing is applied anywhere and every replica keeps its
version. A replica whose commit fails has restored its previous weights itself
(see the commit route) while the others moved on: it is **quarantined** (named in
the result and in ``quarantined``; later updates skip it) rather than silently
left a version behind; ``readmit`` takes it back once it has been brought up to date.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from vllm_specrl.sync.clients.response_check import EngineKeyRefused
from vllm_specrl.sync.clients.engine_client import EngineClient, WeightSyncError

if TYPE_CHECKING:
    from vllm_specrl.sync.clients.engine_group import EngineGroup


class FleetUpdateError(WeightSyncError):
    """The update was refused before any replica applied it; ``replicas`` says which refused and why."""

    def __init__(self, message: str, replicas: dict[str, str]):
        self.replicas = replicas
        super().__init__(message, [f"{url}: {why}" for url, why in replicas.items()])


class FleetClient:
    """All-or-nothing weight updates over several ``EngineClient`` replicas."""

    def __init__(self, urls: list[str], api_key: str | None = None, **client_kwargs: Any):
        if not urls:
            raise ValueError("a fleet needs at least one replica URL")
        client_kwargs.setdefault("progress", False)
        self.replicas = {url.rstrip("/"): EngineClient(url, api_key=api_key, **client_kwargs) for url in urls}
        self.quarantined: dict[str, str] = {}

    @property
    def active(self) -> dict[str, EngineClient]:
        return {url: c for url, c in self.replicas.items() if url not in self.quarantined}

    def _each(self, fn, clients: dict[str, EngineClient]) -> dict[str, tuple[bool, Any]]:
        """``fn(url, client)`` on every replica at once: ``url -> (ok, result or error text)``."""
        def run(item):
            url, client = item
            try:
                return url, (True, fn(url, client))
            except EngineKeyRefused:
                raise  # a setting to fix, not a replica to quarantine or retry
            except Exception as exc:  # noqa: BLE001 - collected per replica, reported together
                return url, (False, str(exc))
        if len(clients) <= 1:  # no thread for one replica: an interrupt reaches the request itself
            return dict(map(run, clients.items()))
        pool = ThreadPoolExecutor(len(clients))
        try:
            return dict(pool.map(run, clients.items()))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def update_policy(self, named_tensors: Any, version: int, pause: str = "keep", keep_mtp: bool = False) -> dict:
        return self._update("policy", named_tensors, version, pause, keep_mtp=keep_mtp)

    def update_draft(self, named_tensors: Any, version: int, pause: str = "none",
                     trainer_report: dict | None = None) -> dict:
        return self._update("draft", named_tensors, version, pause, trainer_report)

    def _update(self, target: str, named_tensors: Any, version: int, pause: str,
                trainer_report: dict | None = None, keep_mtp: bool = False) -> dict:
        if isinstance(named_tensors, dict):
            named_tensors = named_tensors.items()
        named = [(k, v.detach()) for k, v in named_tensors]  # read once, sent to every replica
        clients = self.active
        if not clients:
            raise FleetUpdateError("every replica is quarantined", dict(self.quarantined))
        staged = self._each(lambda url, c: c.stage(target, named, version, trainer_report, keep_mtp), clients)
        ready = {url: res for url, (ok, res) in staged.items() if ok}
        refused = {url: res for url, (ok, res) in staged.items() if not ok}
        if not refused:
            prepared = self._each(lambda url, c: c.prepare(ready[url]), clients)
            refused = {url: res for url, (ok, res) in prepared.items() if not ok}
        if refused:
            self._each(lambda url, c: c.abort(ready[url]), {u: clients[u] for u in ready})
            raise FleetUpdateError(f"{target} v{version} refused by {len(refused)} of {len(clients)} replicas; "
                                   "aborted on all, nothing applied", refused)
        committed = self._each(lambda url, c: c.commit(ready[url], pause), clients)
        failed = {url: res for url, (ok, res) in committed.items() if not ok}
        for url, why in failed.items():
            self.quarantined[url] = f"{target} v{version} failed to apply: {why}"
        return {"target": target, "version": version,
                "committed": sorted(url for url, (ok, _) in committed.items() if ok),
                "quarantined": {url: self.quarantined[url] for url in failed},
                "replicas": {url: res for url, (ok, res) in committed.items() if ok}}

    def native(self) -> "EngineGroup":
        """The active replicas as one client of vLLM's native weight-transfer API (``EngineGroup``: a
        ``specrl_gloo`` broadcast, or ``send_shm`` on one host), all or none, as this fleet's updates."""
        from vllm_specrl.sync.clients.engine_group import EngineGroup

        return EngineGroup(list(self.active.values()))

    def readmit(self, url: str) -> None:
        """Take a quarantined replica back (after updating it directly, e.g. ``replicas[url].update_policy``)."""
        self.quarantined.pop(url.rstrip("/"), None)

    def report_trainer(self, report: dict) -> dict[str, tuple[bool, Any]]:
        """An online trainer's report to every replica (quarantined ones included)."""
        return self._each(lambda url, c: c.report_trainer(report), self.replicas)

    def statuses(self) -> dict[str, tuple[bool, Any]]:
        """Each replica's ``/specrl/status`` (quarantined ones included): ``url -> (ok, status or error)``."""
        return self._each(lambda url, c: c.status(), self.replicas)

    def versions(self) -> dict[str, dict]:
        """Each replica's served versions, read from its status."""
        return {url: (res["versions"] if ok else {"error": res}) for url, (ok, res) in self.statuses().items()}
