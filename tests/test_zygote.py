"""The test zygote (tests/zygote.py) runs a snippet as a fresh ``python -c`` would: its own
environment and nothing else, its output, its exit status, a time limit that kills what it started,
and no plugin or engine state carried over from the zygote. No engine starts here.

Engines: short snippets in the session's zygote (no vLLM engine), one of which starts a sleeping
child; the server zygote's children run ``vllm`` commands that start no engine (``--version``, a
usage error, ``serve`` of a model that does not exist).
"""

import os
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from helpers import _server_zygote, _zygote, result_json, run_python
from vllm_specrl.launcher import VLLMServer, cpu_env


@pytest.fixture(scope="module")
def zygote():
    z = _zygote()
    if z is None:
        pytest.skip("SPECRL_TEST_ZYGOTE=0: snippets run in fresh interpreters")
    run_python("pass")  # started (if no test before started it) with the whole environment
    return z


def test_a_snippet_sees_exactly_its_environment_and_prints_both_streams(zygote, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "HOME"}  # the zygote itself has HOME
    returncode, out = zygote.run(textwrap.dedent("""
        import json, os, sys
        print("to stderr", file=sys.stderr)
        print("RESULT " + json.dumps({"mine": os.environ.get("SPECRL_ZYGOTE_PROBE"), "home": os.environ.get("HOME"),
                                      "cwd": os.getcwd(), "name": __name__, "argv": sys.argv}))
    """), {**env, "SPECRL_ZYGOTE_PROBE": "b"}, timeout=60)
    assert returncode == 0 and "to stderr" in out
    assert result_json(out) == {"mine": "b", "home": None, "cwd": str(tmp_path), "name": "__main__", "argv": ["-c"]}


def test_vllm_is_preloaded_but_no_plugin_is_loaded_until_the_snippet_asks(zygote):
    out = run_python("""
        import json, sys
        import vllm.plugins
        print("RESULT " + json.dumps({"vllm_preloaded": "vllm.v1.engine.core" in sys.modules,
                                      "plugins_loaded": vllm.plugins.plugins_loaded,
                                      "specrl_imported": any(m.startswith("vllm_specrl") for m in sys.modules)}))
    """)
    assert result_json(out) == {"vllm_preloaded": True, "plugins_loaded": False, "specrl_imported": False}


@pytest.mark.parametrize("body, code", [("raise ValueError('boom')", 1), ("import sys; sys.exit(3)", 3),
                                        ("import os; os._exit(4)", 4)])
def test_a_failing_snippet_fails_with_its_status_and_traceback(zygote, body, code):
    returncode, out = zygote.run(body, dict(os.environ), timeout=60)
    assert returncode == code
    if code == 1:
        assert "ValueError: boom" in out
    run_python(body, expect_failure=True)


def test_a_snippet_past_its_time_is_killed_with_what_it_started(zygote, tmp_path):
    marker = tmp_path / "grandchild.pid"
    with pytest.raises(subprocess.TimeoutExpired):  # the snippet would sleep 600 s
        run_python(textwrap.dedent(f"""
            import subprocess, sys, time
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            open({str(marker)!r}, "w").write(str(child.pid))
            print("started", flush=True)
            time.sleep(600)
        """), timeout=10)
    pid = int(marker.read_text())
    for _ in range(50):
        status = Path(f"/proc/{pid}/status")
        if not status.exists() or "State:\tZ" in status.read_text():  # gone, or dead and not yet reaped
            break
        time.sleep(0.1)
    else:
        pytest.fail("the snippet's own child outlived the time limit")
    # The zygote still serves the next snippet.
    assert result_json(run_python('print("RESULT 1")')) == 1


@pytest.fixture(scope="module")
def server_zygote():
    z = _server_zygote()
    if z is None:
        pytest.skip("SPECRL_TEST_ZYGOTE=0: servers start as a user starts them")
    return z


def test_a_vllm_command_forked_by_the_server_zygote_prints_and_exits_as_the_script_would(server_zygote, tmp_path):
    out = tmp_path / "out.log"
    child = server_zygote.start(["vllm", "--version"], cpu_env(), str(out))
    assert child.wait(120) == 0
    import vllm

    assert vllm.__version__ in out.read_text()
    usage = server_zygote.start(["vllm", "no-such-command"], cpu_env(), str(tmp_path / "usage.log"))
    assert usage.wait(120) == 2 and usage.poll() == 2 and usage.returncode == 2
    assert "invalid choice" in (tmp_path / "usage.log").read_text()


def test_a_server_launched_in_the_suite_comes_from_the_zygote_and_its_failure_is_seen(server_zygote, tmp_path):
    """``VLLMServer._start_process`` (patched by tests/conftest.py) forks ``vllm serve`` from the zygote; a server
    that dies starting is reported as ``started`` reports a fresh process's death, with its log."""
    from zygote import ZygoteChild

    server = VLLMServer(tmp_path / "no-such-model", log_path=tmp_path / "serve.log", startup_timeout_s=120)
    with pytest.raises(RuntimeError, match="vllm serve exited with 1"):
        server.start()
    assert isinstance(server.proc, ZygoteChild) and server.proc.poll() == 1
    assert "no-such-model" in (tmp_path / "serve.log").read_text()
    server.stop()  # nothing left to stop: no error


def test_a_variable_the_zygotes_imports_set_does_not_keep_a_process_that_imported_vllm_away():
    from zygote import same_import_time_environment

    started = {"LD_PRELOAD": "libiomp5.so", "HOME": "/root"}
    after = {**started, "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor"}
    assert same_import_time_environment({"LD_PRELOAD": "libiomp5.so"}, started, after)
    assert same_import_time_environment({"LD_PRELOAD": "libiomp5.so", "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor",
                                         "VLLM_PLUGINS": "specrl"}, started, after)
    assert not same_import_time_environment({"LD_PRELOAD": "libiomp5.so", "TORCHINDUCTOR_CACHE_DIR": "/x"},
                                            started, after)
    assert not same_import_time_environment({}, started, after)  # no Intel OpenMP preloaded
    assert not same_import_time_environment({"LD_PRELOAD": "libiomp5.so", "OMP_NUM_THREADS": "1"}, started, after)


def test_requests_that_reach_the_server_zygote_together_are_all_forked(server_zygote, tmp_path):
    """Two requests in one write (threads launching servers at once): both forked, both statuses reported."""
    server_zygote.start(["vllm", "--version"], cpu_env(), str(tmp_path / "first.log")).wait(120)
    with server_zygote.lock:
        requests = [server_zygote.request_line("import sys\nsys.exit(3)\n", cpu_env(), str(tmp_path / f"{n}.log"))
                    for n in range(2)]
        ids = [i for i, _ in requests]
        server_zygote.proc.stdin.write("".join(line for _, line in requests))
        server_zygote.proc.stdin.flush()
    with server_zygote.exited:
        assert server_zygote.exited.wait_for(lambda: all(i in server_zygote.pids for i in ids), 60)
        pids = [server_zygote.pids.pop(i) for i in ids]
        assert server_zygote.exited.wait_for(lambda: all(p in server_zygote.statuses for p in pids), 60)
        assert [server_zygote.statuses[p] for p in pids] == [3, 3]
