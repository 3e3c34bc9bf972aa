"""host_info says which CPU produced a benchmark; EngineProcess drives engine subprocesses in turn.

Engines: small scripted engine processes (no vLLM engine): the harness's own process handling is
what is tested.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from bench_engine import EngineProcess, host_info  # scripts/bench (conftest puts it on the path)

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni
processor\t: 1
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni
"""


def test_reads_model_and_the_isa_flags_that_change_step_costs(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    info = host_info(str(path))
    assert info["cpu_model"] == "AMD EPYC 9R14"
    assert info["isa"] == ["avx2", "avx512f", "avx512_bf16", "avx512_vnni"]


def test_an_avx2_machine_is_told_apart(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text("model name\t: Intel Xeon\nflags\t\t: fpu sse avx avx2 fma\n")
    assert host_info(str(path))["isa"] == ["avx2"]


def test_without_cpuinfo_it_still_names_the_platform(tmp_path: Path) -> None:
    info = host_info(str(tmp_path / "missing"))
    assert info["cpus"] and info["platform"] and "isa" not in info


def test_a_completion_wave_sends_every_prompt_seeded_and_counts_its_tokens() -> None:
    """Against a stub server: each prompt posted once with the wave's settings (its seed when
    given, none otherwise), ``concurrency`` requests in flight at most, tokens in prompt order."""
    import json
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from bench_engine import completion_wave

    bodies, lock, in_flight = [], threading.Lock(), {"now": 0, "most": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                bodies.append(body)
                in_flight["now"] += 1
                in_flight["most"] = max(in_flight["most"], in_flight["now"])
            time.sleep(0.05)
            with lock:
                in_flight["now"] -= 1
            out = json.dumps({"usage": {"completion_tokens": len(body["prompt"])}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        prompts = ["a" * n for n in range(1, 7)]
        tokens, seconds = completion_wave(url, "m", prompts, 9, seeds=[10 + i for i in range(6)], concurrency=2)
        assert tokens == [1, 2, 3, 4, 5, 6] and seconds >= 0.15  # 6 requests, 2 at a time, 50 ms each
        assert in_flight["most"] == 2
        assert sorted((b["prompt"], b["seed"]) for b in bodies) == [("a" * n, 9 + n) for n in range(1, 7)]
        assert all(b["max_tokens"] == 9 and b["temperature"] == 1.0 and b["ignore_eos"] for b in bodies)
        bodies.clear()
        completion_wave(url, "m", prompts[:3], 4)
        assert len(bodies) == 3 and not any("seed" in b for b in bodies)
    finally:
        server.shutdown()


# A stand-in engine: the same --_engine protocol as the benchmark scripts, no vLLM (what is tested is the
# plumbing: commands in order, results back, the child's state kept between commands, failures named).
CHILD = textwrap.dedent("""
    import json, sys, time
    from bench_engine import serve_commands
    cfg = json.loads(sys.argv[2])
    print("vLLM-style chatter on stdout before the engine is up", flush=True)
    if cfg.get("die_before_ready"):
        sys.exit(3)
    seen = []
    def run(command):
        if command.get("hang"):
            time.sleep(60)
        if command.get("die"):
            sys.exit(4)
        seen.append(command["slice"])
        return {"name": cfg["name"], "slices_so_far": list(seen)}
    serve_commands(run)
    print("quit cleanly", file=sys.stderr, flush=True)
""")


def _engine(tmp_path: Path, timeout_s: float = 30, **cfg) -> EngineProcess:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
    return EngineProcess(str(script), {"name": "e", **cfg}, env, str(tmp_path / "engine.log"), timeout_s)


def test_an_engine_process_keeps_its_state_between_commands_and_quits_when_closed(tmp_path: Path) -> None:
    with _engine(tmp_path) as engine:
        assert engine.request({"slice": 0}) == {"name": "e", "slices_so_far": [0]}
        assert engine.request({"slice": 1}) == {"name": "e", "slices_so_far": [0, 1]}
    assert engine.proc.returncode == 0
    log = (tmp_path / "engine.log").read_text()
    assert "quit cleanly" in log and "chatter" in log  # stderr and non-protocol stdout both kept


def test_an_engine_that_dies_or_hangs_is_named_with_its_log(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="ENGINE_READY.*engine.log"):
        _engine(tmp_path, die_before_ready=True)
    with _engine(tmp_path) as engine:
        with pytest.raises(RuntimeError, match="rc=4"):
            engine.request({"slice": 0, "die": True})
    with _engine(tmp_path, timeout_s=3) as engine:
        with pytest.raises(RuntimeError, match="ENGINE_RESULT"):
            engine.request({"slice": 0, "hang": True})
        assert engine.proc.poll() is not None  # killed, not left running


# A loop that keeps its own control flow (as the RL demo's runs do) and takes a turn per command.
TURNS_CHILD = textwrap.dedent("""
    import sys
    from bench_engine import ParentTurns
    name = sys.argv[1]
    print(f"{name}: setting up", flush=True)
    turns = ParentTurns()
    done = []
    for i in range(3):
        command = turns.next()
        assert command == {"step": i}, command
        print(f"{name}: step {i}", flush=True)
        done.append(i)
        turns.report({"name": name, "done": list(done)})
    finish = turns.next()
    turns.report({"name": name, "finish": finish["finish"]})
""")


def test_loops_that_own_their_control_flow_take_turns_and_their_output_is_shown(tmp_path: Path, capsys) -> None:
    """``ParentTurns`` in the child, ``EngineProcess(script, None, ..., log_path=None, args=...)`` in the
    parent: each child announces itself once, runs a step only when told, reports it, and its
    progress lines reach this process's stdout in the order the turns ran."""
    script = tmp_path / "loop.py"
    script.write_text(TURNS_CHILD)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
    with EngineProcess(str(script), None, env, None, 30, args=["a"]) as a, \
            EngineProcess(str(script), None, env, None, 30, args=["b"]) as b:
        for i in range(3):
            first, second = (a, b) if i % 2 == 0 else (b, a)
            assert first.request({"step": i})["done"] == list(range(i + 1))
            assert second.request({"step": i})["done"] == list(range(i + 1))
        assert a.request({"finish": {"replay_of": ["x"]}}) == {"name": "a", "finish": {"replay_of": ["x"]}}
        assert b.request({"finish": {}})["name"] == "b"
    assert a.proc.returncode == 0 and b.proc.returncode == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if ": " in line]
    assert lines == ["a: setting up", "b: setting up", "a: step 0", "b: step 0", "b: step 1", "a: step 1",
                     "a: step 2", "b: step 2"]


def test_engines_take_turns_the_first_rotating_and_a_failed_engine_is_named_not_asked_again(tmp_path: Path) -> None:
    """``engines_alive`` + ``in_turns``, the helper the interleaved benchmarks and the RL demo share:
    round r starts with engine r mod n; an engine that cannot start, or dies on a command, yields its
    error in each of its turns and gets no more commands; the others go on."""
    from bench_engine import engines_alive, in_turns

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

    def start(name: str, **cfg):
        return lambda: EngineProcess(str(script), {"name": name, **cfg}, env, str(tmp_path / f"{name}.log"), 30)

    starts = {"a": start("a"), "b": start("b"), "dead": start("dead", die_before_ready=True), "c": start("c")}
    with engines_alive(starts) as procs:
        assert isinstance(procs["dead"], str) and "ENGINE_READY" in procs["dead"]
        turns = [(name, rnd, result if isinstance(result, str) else result["slices_so_far"])
                 for name, rnd, result in in_turns(
                     procs, 3, lambda name, rnd: {"slice": rnd, "die": name == "c" and rnd == 1})]
    order = [(name, rnd) for name, rnd, _ in turns]
    assert order == [("a", 0), ("b", 0), ("dead", 0), ("c", 0), ("b", 1), ("dead", 1), ("c", 1), ("a", 1),
                     ("dead", 2), ("c", 2), ("a", 2), ("b", 2)]
    results = {(name, rnd): result for name, rnd, result in turns}
    assert results["a", 2] == [0, 1, 2] and results["b", 2] == [0, 1, 2]
    assert results["c", 0] == [0] and "rc=4" in results["c", 1] and results["c", 2] == results["c", 1]
    assert all(procs[name].proc.returncode == 0 for name in ("a", "b"))
