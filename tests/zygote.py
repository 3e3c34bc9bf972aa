"""A pre-imported interpreter that forks one child per engine snippet.

Most engine tests run a short script in a fresh interpreter (vLLM allows one engine per process),
and each fresh interpreter spent ~10 s of a 2-core machine importing vLLM, torch and transformers
before the engine even started. The zygote imports them once; every snippet then runs in a forked
child of it, with the environment, working directory, output and exit status of a fresh
``python -c``. It imports no part of vllm_specrl and starts no engine, thread pool or plugin, so a
child loads the plugin (or not) from its own ``VLLM_PLUGINS`` exactly as a fresh process would.

Run as a script it is the zygote: one JSON request a line on stdin, answered on stdout with the
child's pid, then its exit status.

``--servers`` runs the other kind, for ``vllm serve`` (``ServerZygote``): it also imports the OpenAI
server, forks a ``vllm serve`` per request without waiting for it (servers run side by side and for a
whole module), and reports each one's exit status when it ends. A server's own engine core and worker
start as they would under a fresh ``vllm serve``; what is saved is the API server's imports (~14 s on 2
cores of a tiny model's ~20 s to ready).
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
SERVER_PRELOAD = (*PRELOAD, "vllm.entrypoints.cli.main", "vllm.entrypoints.cli.serve",
                  "vllm.entrypoints.openai.api_server")


def same_import_time_environment(env: dict[str, str], started_with: dict[str, str],
                                 after_imports: dict[str, str]) -> bool:
    """Whether ``env`` agrees with a zygote's, in the variables read while the preloaded libraries load.
    A variable the zygote's own imports set (vLLM sets a few, e.g. ``TORCHINDUCTOR_CACHE_DIR``) agrees
    when ``env`` lacks it or holds the same value: a process that imported vLLM holds it too."""
    set_by_imports = after_imports.keys() - started_with.keys()
    for key in {*env, *started_with}:
        if not key.startswith(IMPORT_TIME_PREFIXES) or env.get(key) == started_with.get(key):
            continue
        if key in set_by_imports and env.get(key) in (None, after_imports[key]):
            continue
        return False
    return True


def _run_child(request: dict, reply_fd: int, sigint=signal.SIG_DFL) -> None:
    """In the forked child: become the requested ``python -c`` and never return."""
    rc = 1
    try:
        os.close(reply_fd)
        os.setpgrp()  # a timeout kills the snippet and whatever it started
        signal.signal(signal.SIGINT, sigint)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        with open(request["out"], "wb", buffering=0) as out, open(os.devnull, "rb") as null:
            os.dup2(null.fileno(), 0)
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
        # The child's standard streams for the rest of its life: no context manager can hold them.
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False, buffering=1)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False, buffering=1)  # noqa: SIM115
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
    reply.write(json.dumps({"ready": True, "env": dict(os.environ)}) + "\n")
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


def serve_servers() -> None:
    """The server zygote's loop: import once, fork a ``vllm serve`` per request and reply with its pid
    at once; report each child's exit status (``{"exited": pid, "rc": rc}``) when it ends."""
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    reply = os.fdopen(reply_fd, "w", buffering=1)
    for name in SERVER_PRELOAD:
        __import__(name)
    # vLLM names its processes (VLLM::EngineCore, ...) with setproctitle, which finds the memory it
    # writes the title into on its first call: make that call here, before a child replaces its environment.
    import setproctitle

    setproctitle.setproctitle(setproctitle.getproctitle())
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    reply.write(json.dumps({"ready": True, "env": dict(os.environ)}) + "\n")
    stdin, pending = sys.stdin.fileno(), b""
    while True:
        readable, _, _ = select.select([stdin, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                reply.write(json.dumps({"exited": pid, "rc": os.waitstatus_to_exitcode(status)}) + "\n")
        if stdin in readable:
            # Read the descriptor itself (select sees it, not what a buffered reader holds): every
            # complete line is a request, however many arrived together.
            data = os.read(stdin, 1 << 16)
            if not data:
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    # A fresh interpreter's signal set-up: vLLM and uvicorn install their own handlers.
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_r)
                    os.close(wake_w)
                    _run_child(request, reply_fd, sigint=signal.default_int_handler)
                reply.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class ZygoteChild:
    """A server forked by the server zygote, with the parts of ``subprocess.Popen`` that
    ``VLLMServer`` uses (it is the zygote's child, not ours: its exit status comes from the zygote)."""

    def __init__(self, pid: int, exited: threading.Condition, statuses: dict[int, int]):
        self.pid = pid
        self._exited = exited
        self._statuses = statuses
        self.returncode: int | None = None

    def poll(self) -> int | None:
        with self._exited:
            if self.pid not in self._statuses and not _exists(self.pid):
                # reaped by the zygote, its exit status on the way: wait for it rather than report it running
                self._exited.wait_for(lambda: self.pid in self._statuses, 10)
            self.returncode = self._statuses.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._exited:
            if not self._exited.wait_for(lambda: self.pid in self._statuses, timeout):
                raise subprocess.TimeoutExpired(f"<zygote child {self.pid}>", timeout)
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ZygoteHandle:
    """The test process's handle on a zygote process: started on first use with the environment of the
    first request, it then serves the environments that agree with that one at import time."""

    ARGS: tuple[str, ...] = ()
    LOG = "zygote.log"

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.env_after_imports: dict[str, str] = {}
        self.lock = threading.Lock()

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a child of this zygote is the same as a fresh interpreter in ``env``."""
        return self.proc is None or same_import_time_environment(env, self.env, self.env_after_imports)

    def _start(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        with open(self.workdir / self.LOG, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, __file__, *self.ARGS], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=env, text=True, bufsize=1)
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"the test zygote {' '.join(self.ARGS)} died while importing vLLM")
        self.env_after_imports = json.loads(ready)["env"]

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class ServerZygote(ZygoteHandle):
    """The server zygote (``--servers``): a server whose import-time environment differs from the first
    one's is not its to start."""

    ARGS = ("--servers",)
    LOG = "server-zygote.log"

    def __init__(self, workdir: Path):
        super().__init__(workdir)
        self.exited = threading.Condition()
        self.statuses: dict[int, int] = {}
        self.pids: dict[int, int] = {}
        self.requests = 0

    def _start(self, env: dict[str, str]) -> None:
        super()._start(env)
        threading.Thread(target=self._read_replies, args=(self.proc,), daemon=True).start()

    def _read_replies(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            message = json.loads(line)
            with self.exited:
                if "exited" in message:
                    self.statuses[message["exited"]] = message["rc"]
                else:
                    self.pids[message["id"]] = message["pid"]
                self.exited.notify_all()

    def request_line(self, code: str, env: dict[str, str], out: str) -> tuple[int, str]:
        """A new request's id and its line for the zygote: fork and run ``code`` (the caller holds ``lock``)."""
        self.requests += 1
        return self.requests, json.dumps({"id": self.requests, "code": code, "env": env, "cwd": os.getcwd(),
                                          "out": out}) + "\n"

    def start(self, argv: list[str], env: dict[str, str], out: str, timeout: float = 60) -> ZygoteChild:
        """Fork ``argv`` (``vllm serve ...``, the ``vllm`` script's main) with ``env``, output to ``out``."""
        code = ("import sys\nfrom vllm.entrypoints.cli.main import main\n"
                f"sys.argv = {['vllm', *argv[1:]]!r}\nsys.exit(main())\n")
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start(env)
            request_id, line = self.request_line(code, env, out)
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        with self.exited:
            if not self.exited.wait_for(lambda: request_id in self.pids, timeout):
                raise RuntimeError("the server zygote did not fork the server")
            return ZygoteChild(self.pids.pop(request_id), self.exited, self.statuses)



class Zygote(ZygoteHandle):
    """The snippet zygote: one request at a time."""

    def __init__(self, workdir: Path):
        super().__init__(workdir)
        self.runs = 0

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


if __name__ == "__main__":
    serve_servers() if sys.argv[1:] == ["--servers"] else serve()
