"""A pre-imported interpreter that forks one child per engine snippet.

Most engine tests run a short script in a fresh interpreter (vLLM allows one engine per process),
and each fresh interpreter spent ~10 s of a 2-core machine importing vLLM, torch and transformers
before the engine even started. The zygote imports them once; every snippet then runs in a forked
child of it, with the environment, working directory, output and exit status of a fresh
``python -c``. It imports no part of vllm_specrl and starts no engine, thread pool or plugin, so a
child loads the plugin (or not) from its own ``VLLM_PLUGINS`` exactly as a fresh process would.

Run as a script it is the zygote: one JSON request a line on stdin, answered on stdout with the
child's pid, then its exit status.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

# Read when the preloaded libraries load (logging set-up, the OpenMP runtime, the allocator): a
# snippet whose environment differs from the zygote's in any of them needs a fresh interpreter.
IMPORT_TIME_PREFIXES = ("VLLM_LOGGING", "VLLM_CONFIGURE_LOGGING", "LD_", "PYTHON", "OMP_", "KMP_", "GOMP_",
                        "MKL_", "MALLOC_", "TORCH", "VLLM_TARGET_DEVICE", "TRANSFORMERS", "HF_")
PRELOAD = ("torch", "transformers", "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine",
           "vllm.v1.engine.core", "vllm.v1.worker.gpu_model_runner", "vllm.model_executor.models.llama",
           "vllm.model_executor.models.qwen2", "scipy.stats", "safetensors.torch")


def _run_child(request: dict, reply_fd: int) -> None:
    """In the forked child: become the requested ``python -c`` and never return."""
    rc = 1
    try:
        os.close(reply_fd)
        os.setpgrp()  # a timeout kills the snippet and whatever it started
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        with open(request["out"], "wb", buffering=0) as out, open(os.devnull, "rb") as null:
            os.dup2(null.fileno(), 0)
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False, buffering=1)
        sys.stderr = open(2, "w", closefd=False, buffering=1)
        sys.argv = ["-c"]
        main = {"__name__": "__main__", "__builtins__": __builtins__}
        try:
            exec(compile(request["code"], "<string>", "exec"), main)
            rc = 0
        except SystemExit as exit_:
            rc = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if not isinstance(exit_.code, (int, type(None))):
                print(exit_.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - the snippet's own error, printed as python -c prints it
            import traceback

            traceback.print_exc()
            rc = 1
        for hook in (sys.stdout.flush, sys.stderr.flush):
            try:
                hook()
            except Exception:  # noqa: BLE001
                pass
        # Exit handlers (atexit) run as in a fresh interpreter: vLLM shuts its engine down there.
        import atexit

        atexit._run_exitfuncs()
    finally:
        os._exit(rc)


def serve() -> None:
    """The zygote's loop: import once, then fork a child per request, one at a time."""
    # Replies go on a descriptor of their own; what the imports print goes to stderr (the zygote's log).
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    reply = os.fdopen(reply_fd, "w", buffering=1)
    for name in PRELOAD:
        __import__(name)
    reply.write(json.dumps({"ready": True}) + "\n")
    while line := sys.stdin.readline():
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(request, reply_fd)
        reply.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")


class Zygote:
    """The test process's handle on one zygote (started on first use, one request at a time)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.runs = 0

    def _start(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        with open(self.workdir / "zygote.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, env=env, text=True, bufsize=1)
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError("the test zygote died while importing vLLM")

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a child of this zygote is the same as a fresh interpreter in ``env``."""
        if self.proc is None:
            return True
        def import_time(e):
            return {k: v for k, v in e.items() if k.startswith(IMPORT_TIME_PREFIXES)}
        return import_time(env) == import_time(self.env)

    def _read(self, timeout: float | None) -> dict | None:
        if timeout is not None and not select.select([self.proc.stdout], [], [], max(timeout, 0))[0]:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the test zygote died")
        return json.loads(line)

    def run(self, code: str, env: dict[str, str], timeout: float) -> tuple[int, str]:
        """Run ``code`` as ``python -c`` would in ``env``; (exit status, stdout and stderr)."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start(env)
            self.runs += 1
            out = self.workdir / f"run-{os.getpid()}-{self.runs}.log"
            self.proc.stdin.write(json.dumps({"code": code, "env": env, "cwd": os.getcwd(), "out": str(out)}) + "\n")
            self.proc.stdin.flush()
            pid = self._read(None)["pid"]
            done = self._read(timeout)
            if done is None:
                os.killpg(pid, signal.SIGKILL)
                self._read(None)
                text = out.read_text(errors="replace")
                out.unlink(missing_ok=True)
                raise subprocess.TimeoutExpired(["<zygote>", "-c", code[:200]], timeout, output=text)
            text = out.read_text(errors="replace")
            out.unlink(missing_ok=True)
            return done["rc"], text

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


if __name__ == "__main__":
    serve()
