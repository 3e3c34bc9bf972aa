"""One vLLM engine per subprocess for the benchmark scripts (vLLM allows one engine per process).

A script re-runs itself with ``--_engine <json config>``; the child prints one
``ENGINE_RESULT <json>`` line, which the parent reads back. ``EngineProcess`` keeps such a
child alive and sends it one JSON command per measurement (``serve_commands`` in the child),
so a benchmark can measure several engines in turn, slice by slice (``engines_alive`` starts them,
``in_turns`` takes the turns: the shared helper of ``bench_rollout``, ``bench_history`` and the RL demo);
``ParentTurns`` is the child's side for a loop that keeps its own control flow (the RL demo's runs,
step by step).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm_specrl.host import host_info  # noqa: F401 - the benchmarks read it from here

TAG = "ENGINE_RESULT "

def completion_wave(url: str, model: str, prompts: Sequence[str], max_tokens: int,
                    seeds: Sequence[int] | None = None, concurrency: int | None = None,
                    timeout_s: float = 600.0) -> tuple[list[int], float]:
    """``prompts`` through ``/v1/completions``, ``concurrency`` in flight (default: all at once), T = 1
    and ``ignore_eos`` (every request runs ``max_tokens``), seeded per request by ``seeds`` or not:
    each request's completion tokens and the wave's wall seconds."""
    import requests

    def one(i: int) -> int:
        body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 1.0,
                "ignore_eos": True}
        if seeds is not None:
            body["seed"] = seeds[i]
        r = requests.post(url + "/v1/completions", timeout=timeout_s, json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency or max(1, len(prompts))) as pool:
        tokens = list(pool.map(one, range(len(prompts))))
    return tokens, time.perf_counter() - t0


def report_result(result: Any) -> None:
    """In the child: hand the result to the parent."""
    print(TAG + json.dumps(result), flush=True)


def run_engine_subprocess(script: str, cfg: dict, env: dict[str, str], timeout_s: float) -> Any:
    """In the parent: run ``script --_engine cfg``; its result, or a string saying why there is none."""
    try:
        proc = subprocess.run([sys.executable, script, "--_engine", json.dumps(cfg)], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"engine timed out after {timeout_s:.0f} s"
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    return f"engine failed (rc={proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}"


# --- engines kept alive and driven in turn (interleaved measurement) ----------------------

READY = "ENGINE_READY"


def serve_commands(run: Any, stdin: Any = None) -> None:
    """In the child, after the engine is set up: announce it, then run ``run(command)`` for every JSON
    command line on stdin and report each result, until ``{"quit": true}`` or end of input."""
    stdin = stdin or sys.stdin
    print(READY, flush=True)
    for line in stdin:
        command = json.loads(line)
        if command.get("quit"):
            return
        report_result(run(command))


class ParentTurns:
    """In the child, for a loop that owns its control flow: ``next()`` blocks until the parent's next
    command (announcing readiness the first time), ``report()`` hands back that command's result.

    The RL demo's runs take turns step by step this way: while one run's step is timed, the others
    wait on their stdin and use no CPU."""

    def __init__(self, stdin: Any = None):
        self.stdin = stdin or sys.stdin
        self.announced = False

    def next(self) -> dict:
        if not self.announced:
            print(READY, flush=True)
            self.announced = True
        line = self.stdin.readline()
        if not line:
            raise RuntimeError("the parent closed this child's stdin before sending its next command")
        return json.loads(line)

    def report(self, result: Any) -> None:
        report_result(result)


class EngineProcess:
    """In the parent: one engine subprocess (``script --_engine cfg``) kept alive between commands, so
    several engines can be measured in turn, slice by slice.

    Why: on a shared 2-core VM the same engine's step time drifts over a minute, and two engines of
    one configuration read apart by more than many effects measured, so cells measured one engine
    after another mix that drift into the ratio. Engines alive together, each measured while the others wait
    (blocked on their stdin, no CPU), see the same drift."""

    def __init__(self, script: str, cfg: dict | None, env: dict[str, str], log_path: str | None, timeout_s: float,
                 args: Sequence[str] = ()):
        """Runs ``script --_engine cfg``, or ``script *args`` when ``cfg`` is None; its stderr and
        non-protocol stdout go to ``log_path``, or with None to this process's stdout and stderr
        (a child whose progress the user watches)."""
        self.timeout_s = timeout_s
        self.log = open(log_path, "w") if log_path else None  # noqa: SIM115 - closed in close()
        argv = ["--_engine", json.dumps(cfg)] if cfg is not None else list(args)
        self.proc = subprocess.Popen([sys.executable, script, *argv], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log or None)
        self.closed = False
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self._wait_for(READY)

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # the child exited

    def _wait_for(self, prefix: str) -> str:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                break
            if line.startswith(prefix):
                return line[len(prefix):]
            (self.log or sys.stdout).write(line)
            if self.log is None:
                sys.stdout.flush()
        try:  # let a child that is exiting finish, so its exit status is its own
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.close()
        where = f"its log: {self.log.name}" if self.log else "its output is above"
        raise RuntimeError(f"engine exited or timed out waiting for {prefix.strip()} "
                           f"(rc={self.proc.returncode}); {where}")

    def request(self, command: dict) -> Any:
        """Send one command and wait for its result."""
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._wait_for(TAG))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self.log:
            self.log.close()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@contextmanager
def engines_alive(starts: Mapping[str, Callable[[], EngineProcess]],
                  announce: Callable[[str], None] = lambda name: None) -> Iterator[dict[str, EngineProcess | str]]:
    """Starts every engine, one after another (each start alone on the cores), and keeps them all
    alive until the block ends; an engine that fails to start is its error message instead."""
    with ExitStack() as stack:
        procs: dict[str, EngineProcess | str] = {}
        for name, start in starts.items():
            announce(name)
            try:
                procs[name] = stack.enter_context(start())
            except RuntimeError as e:
                procs[name] = str(e)
        yield procs


def in_turns(procs: dict[str, EngineProcess | str], rounds: int,
             command: Callable[[str, int], dict]) -> Iterator[tuple[str, int, Any]]:
    """Round r sends ``command(name, r)`` to every engine in turn, the first rotating by one each round
    (no engine always measured first, or right after another's turn), and yields (name, r, its result).
    An engine that failed (to start, or on a command) yields its error message and is asked no more;
    ``procs`` then holds that message in its place."""
    names = list(procs)
    for rnd in range(rounds):
        for i in range(len(names)):
            name = names[(i + rnd) % len(names)]
            proc = procs[name]
            if isinstance(proc, str):
                yield name, rnd, proc
                continue
            try:
                yield name, rnd, proc.request(command(name, rnd))
            except RuntimeError as e:
                procs[name] = str(e)
                yield name, rnd, procs[name]
