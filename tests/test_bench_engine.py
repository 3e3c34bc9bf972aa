"""host_info: benchmark JSONs say which CPU (and which vector extensions) produced them."""

from __future__ import annotations

from pathlib import Path

from vllm_specrl.bench_engine import host_info

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

    from vllm_specrl.bench_engine import completion_wave

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
