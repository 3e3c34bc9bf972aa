"""What the processes of one ``vllm serve`` share: a directory, a JSON record, a lock.

``vllm serve --data-parallel-size N`` (or ``--api-server-count N``) runs N
API-server processes behind one port; the kernel hands each connection to any
of them. An update's chunks and its commit may reach different processes, and a
completion may be answered by a process that did not run the commit. So what
the ``/specrl`` routes know (the versions served, open uploads, the last
failure, the online trainer's report, the stale-draft guard's window) cannot
live in one process's memory: it lives in a small JSON file, replaced
atomically and changed under an exclusive ``flock``, that every process reads
(a ``stat`` per read, the file re-read only when it changed).

The directory: with several API servers vLLM sets ``PROMETHEUS_MULTIPROC_DIR``
(a fresh temporary directory, inherited by every API server and engine core
it starts), so ``<that>/specrl``; with one API server, a directory named after
the API server's pid (its engine cores are its children). The engine cores
publish their adaptive-k state into the same directory.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STATE_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def several_api_servers() -> bool:
    """vLLM runs several API servers (it set up Prometheus' multiprocess mode for them)."""
    return bool(os.environ.get(MULTIPROC_ENV))


def instance_dir(engine_core: bool = False) -> Path:
    """This ``vllm serve``'s shared directory, from an API server or (``engine_core``) an engine core."""
    shared = os.environ.get(MULTIPROC_ENV)
    if shared:
        return Path(shared) / "specrl"
    frontend = os.getppid() if engine_core else os.getpid()
    return STATE_DIR / f"vllm-specrl-{frontend}"


def remove_own_instance_dir() -> None:
    """At a single API server's exit: its directory goes (vLLM removes a multiprocess one itself)."""
    if not several_api_servers():
        shutil.rmtree(instance_dir(), ignore_errors=True)


class SharedRecord:
    """A JSON object in ``path`` that every process reads and changes under an exclusive lock."""

    def __init__(self, path: Path, defaults: dict[str, Any], fresh: bool = False):
        """``fresh``: start from ``defaults`` whatever the file holds (a sole API server: a file left by a
        crashed process whose pid this one reuses must not say what it served); otherwise the first
        process creates the record and later ones add only missing keys."""
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        self._cache: tuple[tuple[int, int], dict] | None = None
        with self.changing() as record:
            if fresh:
                record.clear()
            for key, value in defaults.items():
                record.setdefault(key, json.loads(json.dumps(value)))

    def _load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}

    def read(self) -> dict:
        """The record as last written (do not change it: use ``changing``)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return {}
        key = (st.st_ino, st.st_mtime_ns)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._load())
        return self._cache[1]

    @contextlib.contextmanager
    def changing(self) -> Iterator[dict]:
        """Read, change and replace the record with no other process in between."""
        fd = os.open(self.lock_path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            record = self._load()
            yield record
            tmp_fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
            with os.fdopen(tmp_fd, "w") as fh:
                json.dump(record, fh)
            os.replace(tmp, self.path)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


class ProcessLock:
    """An asyncio lock that also excludes the other processes (``flock`` on a file, polled)."""

    POLL_S = 0.01

    def __init__(self, path: Path):
        self.path = path
        self._local = asyncio.Lock()
        self._fd: int | None = None

    async def __aenter__(self) -> ProcessLock:
        await self._local.acquire()
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        await asyncio.sleep(self.POLL_S)
            except BaseException:  # cancelled while waiting
                os.close(fd)
                raise
            self._fd = fd
        except BaseException:
            self._local.release()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        fd, self._fd = self._fd, None
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        finally:
            self._local.release()


def own_instance_dir_cleanup() -> None:
    """Remove this single API server's directory at exit (registered once)."""
    if not getattr(own_instance_dir_cleanup, "_registered", False):
        atexit.register(remove_own_instance_dir)
        own_instance_dir_cleanup._registered = True  # type: ignore[attr-defined]


def read_engine_states(prefix: str, directory: Path | None = None) -> dict[int, dict]:
    """Every engine core's latest ``<prefix>-dp<rank>.json`` in the serve instance's directory, by data-parallel
    rank (a file being replaced or unreadable is skipped)."""
    import re

    directory = directory or instance_dir()
    pattern = re.compile(rf"{re.escape(prefix)}-dp(\d+)\.json$")
    out = {}
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        if match := pattern.match(name):
            try:
                out[int(match.group(1))] = json.loads((directory / name).read_text())
            except (OSError, ValueError):
                continue
    return out
