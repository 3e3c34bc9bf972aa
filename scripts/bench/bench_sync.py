"""Weight-sync throughput and the generation pause it causes, per transport, in one run.

Starts ``vllm serve`` (plugin, worker extension, an EAGLE-3 draft) on a
fixture, then pushes a full policy + draft update through ``EngineClient``
with each transport (shared memory, HTTP), ``--repeats`` times each, and
reports bytes/s next to a plain in-process memcpy of the same tensors
measured in the same run (the ceiling), as a ratio. While one more update
commits, a streaming request measures the pause generation sees: the longest
gap between streamed tokens, against the longest gap without an update.
Output: JSON.

    python scripts/bench/bench_sync.py --fixture real
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import requests
import torch
from safetensors.torch import load_file

from bench_engine import host_info


def memcpy_bytes_per_s(tensors: dict[str, torch.Tensor], repeats: int) -> float:
    dst = {k: torch.empty_like(v) for k, v in tensors.items()}
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    for k, v in tensors.items():  # warm-up: fault the destination pages in
        dst[k].copy_(v)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k, v in tensors.items():
            dst[k].copy_(v)
        times.append(time.perf_counter() - t0)
    return total / statistics.median(times)


def stream_gaps(url: str, model: str, headers: dict, max_tokens: int, out: dict) -> None:
    """Longest gap between streamed chunks of one completion (seconds)."""
    r = requests.post(url + "/v1/completions", headers=headers, stream=True, timeout=600, json={
        "model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 1.0,
        "ignore_eos": True, "stream": True})
    last, gaps = None, []
    for line in r.iter_lines():
        if not line.startswith(b"data:"):
            continue
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
    out["max_gap_s"] = max(gaps) if gaps else None
    out["median_gap_s"] = statistics.median(gaps) if gaps else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=None)
    ap.add_argument("--fixture", default="real", choices=["real", "tiny"])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--draft", type=Path, default=None, help="EAGLE-3 draft (default: a random one)")
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transports", default="shm,http")
    ap.add_argument("--pause", default="keep", help="pause mode for policy commits")
    ap.add_argument("--out", type=Path, default=Path("results/bench_sync.json"))
    args = ap.parse_args()

    from vllm_specrl.fixtures import fixture_target
    from vllm_specrl.proposer.checkpoint import init_draft
    from vllm_specrl.launcher import VLLMServer
    from vllm_specrl.sync.clients.engine_client import EngineClient

    model = Path(args.model or fixture_target(args.fixture, args.fixtures))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    draft = args.draft
    if draft is None:
        draft = args.out.parent / "drafts" / f"{model.parent.name}-random-v{args.draft_vocab_size}"
        if not (draft / "config.json").exists():
            init_draft(model, draft, args.draft_vocab_size, seed=0)
    policy = load_file(model / "model.safetensors")
    draft_w = load_file(draft / "model.safetensors")
    both = {**{f"policy.{k}": v for k, v in policy.items()}, **{f"draft.{k}": v for k, v in draft_w.items()}}
    total_bytes = sum(v.numel() * v.element_size() for v in both.values())
    memcpy = memcpy_bytes_per_s(both, max(3, args.repeats))
    print(f"[sync] {total_bytes / 2**20:.1f} MiB per update (policy + draft); memcpy "
          f"{memcpy / 2**30:.2f} GiB/s", flush=True)

    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    server_args = ["--dtype", args.dtype, "--max-model-len", "1024", "--speculative-config", json.dumps(spec)]
    report = {"benchmark": "weight_sync", "model": str(model), "draft": str(draft),
              "host": host_info(),
              "bytes_per_update": total_bytes, "memcpy_bytes_per_s": memcpy, "transports": {}}
    version = 0
    with VLLMServer(model, server_args, log_path=args.out.parent / "bench_sync_server.log") as srv:
        for transport in args.transports.split(","):
            client = EngineClient(srv.url, transport=transport, progress=False)
            runs = []
            for _ in range(args.repeats):
                version += 1
                t0 = time.perf_counter()
                p = client.update_policy(policy, version=version, pause=args.pause)
                d = client.update_draft(draft_w, version=version)
                wall = time.perf_counter() - t0
                runs.append({"wall_s": wall, "policy_pause_window_s": p["pause_window_s"],
                             "policy_apply_s": p["applied_s"], "draft_apply_s": d["applied_s"],
                             "upload_s": p["upload_s"] + d["upload_s"]})
            wall = statistics.median(r["wall_s"] for r in runs)
            report["transports"][transport] = {
                "runs": runs, "bytes_per_s": total_bytes / wall,
                "ratio_vs_memcpy": total_bytes / wall / memcpy,
                "upload_only_ratio_vs_memcpy": total_bytes / statistics.median(r["upload_s"] for r in runs) / memcpy,
            }
            t = report["transports"][transport]
            print(f"[sync] {transport}: {t['bytes_per_s'] / 2**20:.0f} MiB/s end to end "
                  f"({t['ratio_vs_memcpy']:.1%} of memcpy; upload alone {t['upload_only_ratio_vs_memcpy']:.1%})",
                  flush=True)
        # Pause seen by generation: a streaming request with and without an update during it.
        client = EngineClient(srv.url, progress=False)
        idle: dict = {}
        stream_gaps(srv.url, srv.model, srv.headers, 96, idle)
        during: dict = {}
        th = threading.Thread(target=stream_gaps, args=(srv.url, srv.model, srv.headers, 96, during))
        th.start()
        time.sleep(1.0)
        version += 1
        commit = client.update_policy(policy, version=version, pause=args.pause)
        th.join()
        report["generation_pause"] = {"pause_mode": args.pause, "idle": idle, "during_update": during,
                                      "commit_pause_window_s": commit["pause_window_s"],
                                      "extra_stall_s": (during["max_gap_s"] or 0) - (idle["max_gap_s"] or 0)}
        print(f"[sync] generation: longest token gap {idle['max_gap_s']:.3f} s idle, "
              f"{during['max_gap_s']:.3f} s with a commit (pause window {commit['pause_window_s']:.3f} s)",
              flush=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"[sync] wrote {args.out}")


if __name__ == "__main__":
    main()
