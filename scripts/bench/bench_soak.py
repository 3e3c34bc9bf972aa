"""Soak: hundreds of policy updates under streaming load, with injected faults and malformed input.

One ``vllm serve`` (tiny fixture, float32, EAGLE-3 k=3, the worker extension) serves
streaming OpenAI completions from ``--clients`` threads without pause while the main
thread commits ``--updates`` policy updates (alternating two weight sets, cycling the
pause modes ``keep``/``wait``/``none``, shared memory and HTTP transports). Every
``--fault-every``-th version is armed to fail while applying (a failpoint,
``VLLM_SPECRL_FAULTS``); every ``--fuzz-every``-th iteration also sends a malformed
update (truncated body, wrong shape, out-of-range ``d2t``-like garbage, NaN). It checks
that every refusal and fault left the version where it was, and at the end that the
served greedy outputs equal those of the weights last committed.

Reported (JSON): updates committed, faults injected and recovered, malformed inputs
refused, requests served / failed (a failed or truncated stream counts), shared-memory
files left behind, and resident memory of the server's processes before and after.

    python scripts/bench/bench_soak.py --updates 500 --out benchmarks/cpu/bench_soak.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import psutil
import requests
import torch
from safetensors.torch import load_file, save

from vllm_specrl.faults import FAULTS_ENV
from vllm_specrl.fixtures import build_fixtures, fixture_target
from bench_engine import host_info
from vllm_specrl.proposer.checkpoint import init_draft
from vllm_specrl.launcher import VLLMServer, cpu_env
from vllm_specrl.sync import shm
from vllm_specrl.sync.clients.engine_client import EngineClient, WeightSyncError

PROMPTS = ["def f(x):\n", "import os\n", "class A:\n", "for i in range(3):\n"]


def rss_mb(pid: int) -> float:
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


def stream_forever(url: str, headers: dict, model: str, stop: threading.Event, counts: dict, lock) -> None:
    """Streaming completions back to back; a request fails unless it ends with [DONE] and 24 tokens."""
    i = 0
    while not stop.is_set():
        i += 1
        ok = False
        try:
            with requests.post(url + "/v1/completions", headers=headers, stream=True, timeout=300, json={
                    "model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 24, "temperature": 1.0,
                    "ignore_eos": True, "stream": True}) as r:
                chunks, done = 0, False
                for line in r.iter_lines():
                    if line == b"data: [DONE]":
                        done = True
                    elif line.startswith(b"data: "):
                        chunks += 1
                ok = r.status_code == 200 and done and chunks >= 1
        except requests.RequestException:
            ok = False
        with lock:
            counts["served" if ok else "failed"] += 1


def malformed(original: dict, i: int) -> tuple[str, dict | bytes]:
    name = "model.layers.0.self_attn.q_proj.weight"
    kinds = [("truncated body", save(original)[: 1000 + i]),
             ("wrong shape", {**original, name: original[name][:-1]}),
             ("NaN", {**original, name: torch.full_like(original[name], float("nan"))}),
             ("incomplete", dict(list(original.items())[:3]))]
    return kinds[i % len(kinds)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=Path(".fixtures"))
    ap.add_argument("--updates", type=int, default=500)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--fault-every", type=int, default=25)
    ap.add_argument("--fuzz-every", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("results/bench_soak.json"))
    args = ap.parse_args()

    build_fixtures(args.fixtures, ("tiny",))
    target = fixture_target("tiny", args.fixtures)
    work = args.out.parent / "soak_work"
    init_draft(target, work / "draft", 1024, seed=0)
    original = load_file(target / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    perturbed = {k: (v + 0.1 * v.float().std() * torch.randn(v.shape, generator=gen)).to(v.dtype)
                 if v.dim() == 2 else v for k, v in original.items()}
    # Versions 1-2 set up the reference outputs; armed versions come after.
    faulty = list(range(args.fault_every, 2 * args.updates + 10, args.fault_every))
    env = dict(cpu_env(), **{FAULTS_ENV: ",".join(f"apply:policy:{v}:5" for v in faulty)})
    spec = {"method": "eagle3", "model": str(work / "draft"), "num_speculative_tokens": 3}
    shm_before = sorted(p.name for p in shm.SHM_DIR.glob("*specrl-*"))
    key = "soak-key"
    with VLLMServer(target, ["--dtype", "float32", "--max-model-len", "512", "--speculative-config",
                             json.dumps(spec)], api_key=key, env=env, log_path=work / "serve.log") as srv:
        clients = {t: EngineClient(srv.url, api_key=key, transport=t, progress=False) for t in ("shm", "http")}
        counts, lock, stop = {"served": 0, "failed": 0}, threading.Lock(), threading.Event()
        def greedy() -> list[str]:
            out = requests.post(srv.url + "/v1/completions", headers=srv.headers, timeout=300, json={
                "model": srv.model, "prompt": PROMPTS, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
            return [c["text"] for c in sorted(out.json()["choices"], key=lambda c: c["index"])]

        reference = {"original": greedy()}
        clients["shm"].update_policy(perturbed, version=1)
        reference["perturbed"] = greedy()
        clients["shm"].update_policy(original, version=2)
        assert greedy() == reference["original"] != reference["perturbed"]
        rss_start = rss_mb(srv.proc.pid)
        threads = [threading.Thread(target=stream_forever, args=(srv.url, srv.headers, srv.model, stop, counts, lock),
                                    daemon=True) for _ in range(args.clients)]
        for t in threads:
            t.start()
        t0 = time.time()
        version, committed, faults, recovered, refused, last_weights = 2, 0, 0, 0, 0, original
        modes = ["keep", "wait", "none"]
        rss_trace = []
        for i in range(args.updates):
            if i % 50 == 0:
                rss_trace.append([i, round(rss_mb(srv.proc.pid), 1)])
            weights = perturbed if i % 2 == 0 else original
            client = clients["shm" if i % 3 else "http"]
            if i % args.fuzz_every == 0:
                label, bad = malformed(original, i)
                try:
                    if isinstance(bad, bytes):
                        uid = client._post("/specrl/update/begin", json={"target": "policy",
                                                                         "version": version + 1})["update_id"]
                        r = requests.post(f"{srv.url}/specrl/update/{uid}/tensors", data=bad,
                                          headers=srv.headers, timeout=60)
                        assert r.status_code == 400, (label, r.text)
                        requests.post(f"{srv.url}/specrl/update/{uid}/abort", headers=srv.headers, timeout=60)
                    else:
                        client.update_policy(bad, version=version + 1)
                        raise AssertionError(f"malformed update accepted: {label}")
                except WeightSyncError:
                    pass
                refused += 1
                assert client.status()["versions"]["policy"] == version, label
            try:
                res = client.update_policy(weights, version=version + 1, pause=modes[i % 3])
                version = res["version"]
                committed += 1
                last_weights = weights
            except WeightSyncError as exc:
                assert version + 1 in faulty and "failed while applying" in str(exc), str(exc)
                faults += 1
                recovered += "restored policy" in str(exc)
                assert client.status()["versions"]["policy"] == version
                # The armed version number is skipped; the same weights commit under the next one.
                version = client.update_policy(weights, version=version + 2, pause=modes[i % 3])["version"]
                committed += 1
                last_weights = weights
        stop.set()
        for t in threads:
            t.join(timeout=300)
        elapsed = time.time() - t0
        rss_end = rss_mb(srv.proc.pid)
        served_texts = greedy()
    shm_after = sorted(p.name for p in shm.SHM_DIR.glob("*specrl-*"))
    expected = reference["original" if last_weights is original else "perturbed"]
    report = {"benchmark": "soak", "host": host_info(), "updates_attempted": args.updates,
              "updates_committed": committed,
              "final_policy_version": version, "faults_injected": faults, "faults_recovered": recovered,
              "malformed_updates_refused": refused, "requests_served": counts["served"],
              "requests_failed": counts["failed"], "shm_files_leaked": len(set(shm_after) - set(shm_before)),
              "rss_mb_start": round(rss_start, 1), "rss_mb_end": round(rss_end, 1),
              "rss_mb_every_50_updates": rss_trace,
              "seconds": round(elapsed, 1),
              "final_outputs_equal_last_committed_weights": served_texts == expected}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
