"""One policy update to 1, 2 and 4 engines: a gloo broadcast (``specrl_gloo``) against per-engine fan-out
(``FleetClient`` over HTTP and over shared memory), in one run, and the projection to many replicas.

Starts ``--engines`` plain ``vllm serve`` processes of the policy (the real fixture by default) with
``--weight-transfer-config '{"backend":"specrl_gloo"}'`` and dev mode, kept alive together; for each
engine count N in ``--counts`` and each method, ``--repeats`` full policy updates to the first N
engines, timed from the trainer's call to every engine serving the new version. Methods:

- ``gloo``: ``EngineGroup`` + the ``specrl_gloo`` trainer engine: the trainer sends each tensor once,
  gloo carries it to every worker (staged, validated, applied together);
- ``http``: ``FleetClient(transport="http")``: every replica receives its own upload of the whole model;
- ``shm``: ``FleetClient(transport="shm")``: every replica reads the trainer's shared-memory chunks
  (same host only).

Each update is split into its transfer (until every engine holds the whole update, validated) and its
apply (every engine loading it, in parallel). On one 2-core host the engines' applies share the cores,
so the apply grows with N here and would not on a cluster; the transfer is what one trainer's link
carries. Per method, a least-squares line transfer = a + b * N gives the cost of one engine more; the
projection scales it to the bytes of an 8B policy in bf16 and 64 replicas, plus one apply, with the
caveats in the JSON.

    python scripts/bench/bench_weight_broadcast.py --out benchmarks/cpu/bench_weight_broadcast.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench_engine import host_info

EIGHT_B_BF16_BYTES = 8.03e9 * 2
REPLICAS_PROJECTED = 64


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares time = a + b * n over (n, seconds)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - b * mx, b


def projection(a: float, b: float, apply_one_s: float, model_bytes: int) -> dict:
    scale = EIGHT_B_BF16_BYTES / model_bytes
    transfer = (a + b * REPLICAS_PROJECTED) * scale
    return {"transfer_s_8b_bf16_64_replicas": round(transfer, 1),
            "apply_s_8b_bf16_one_engine_this_cpu": round(apply_one_s * scale, 1),
            "transfer_fixed_s_here": round(a, 3), "transfer_s_per_engine_more_here": round(b, 3),
            "transfer_bandwidth_one_engine_bytes_per_s": round(model_bytes / max(a + b, 1e-9)),
            "how": "transfer: (a + b * 64) * (8B bf16 bytes / this model's bytes); apply (in parallel on every "
                   "replica of a cluster): one engine's apply here, scaled by bytes"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=Path(".fixtures"))
    ap.add_argument("--model", type=Path, default=None, help="policy checkpoint (default: the real fixture)")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--counts", default="1,2,4")
    ap.add_argument("--methods", default="gloo,http,shm")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warm-up", type=int, default=1, help="untimed updates first, per engine count and method "
                    "(the gloo group's first round, the fleet's first connections)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=Path("results/bench_weight_broadcast.json"))
    args = ap.parse_args()

    from safetensors.torch import load_file

    from vllm_specrl.fixtures import build_fixtures, fixture_target
    from vllm_specrl.launcher import VLLMServer, cpu_env, free_port, started
    from vllm_specrl.sync.clients.engine_client import EngineClient
    from vllm_specrl.sync.clients.engine_group import EngineGroup
    from vllm_specrl.sync.clients.fleet import FleetClient
    from vllm_specrl.sync.backends.gloo_backend import (GlooTrainerInitInfo, SpecRLGlooTrainerWeightTransferEngine,
                                                        TensorSource)

    if args.model is None:
        build_fixtures(args.fixtures, ("real",))
    model = args.model or Path(fixture_target("real", args.fixtures))
    weights = {k: v.to(getattr(torch, args.dtype)) for f in sorted(model.glob("*.safetensors"))
               for k, v in load_file(f).items()}
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())

    class TimedGroup(EngineGroup):
        """The round's transfer (every engine received and validated) and apply (every engine loaded it)."""

        def update_weights(self, update_info: dict) -> None:
            t0 = time.perf_counter()
            super().update_weights(update_info)
            self.phases["transfer"] = time.perf_counter() - t0

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            t0 = time.perf_counter()
            super().finish_weight_update(weight_version)
            self.phases["apply"] = time.perf_counter() - t0

    class TimedFleet(FleetClient):
        """Each phase's wall time on every replica at once: stage, prepare, commit."""

        times: list

        def _each(self, fn, clients):
            t0 = time.perf_counter()
            out = super()._each(fn, clients)
            self.times = [*getattr(self, "times", []), time.perf_counter() - t0]
            return out

    counts = [int(c) for c in args.counts.split(",")]
    work = args.out.parent / (args.out.stem + "_work")
    work.mkdir(parents=True, exist_ok=True)
    serve = ["--dtype", args.dtype, "--max-model-len", "512", "--weight-transfer-config",
             json.dumps({"backend": "specrl_gloo"})]
    env = dict(cpu_env(kv_cache_gib=1), VLLM_SERVER_DEV_MODE="1")
    report = {"benchmark": "weight_broadcast", "host": host_info(), "model": str(model), "model_bytes": model_bytes,
              "dtype": args.dtype, "settings": {k: str(v) for k, v in vars(args).items()}, "cells": []}
    version = 0
    servers = [VLLMServer(model, serve, env=env, log_path=work / f"engine{i}.log", startup_timeout_s=900)
               for i in range(args.engines)]
    with started(*servers):
        for n in counts:
            urls = [s.url for s in servers[:n]]
            for method in args.methods.split(","):
                times, transfers, applies = [], [], []
                if method == "gloo":
                    group = TimedGroup([EngineClient(u, progress=False) for u in urls])
                    trainer = SpecRLGlooTrainerWeightTransferEngine.trainer_init(
                        GlooTrainerInitInfo("127.0.0.1", free_port(), group.world_size, rank=0),
                        client=group, source=TensorSource(weights))
                for i in range(args.warm_up + args.repeats):
                    version += 1
                    t0 = time.perf_counter()
                    if method == "gloo":
                        group.phases = {}
                        trainer.send_weights(weight_version=str(version))
                        phases = group.phases
                    else:
                        fleet = TimedFleet(urls, transport=method, progress=False)
                        fleet.update_policy(weights, version=version)
                        phases = {"transfer": fleet.times[0] + fleet.times[1], "apply": fleet.times[2]}
                    if i >= args.warm_up:
                        times.append(time.perf_counter() - t0)
                        transfers.append(phases["transfer"])
                        applies.append(phases["apply"])
                served = [EngineClient(u, progress=False).status()["versions"]["policy"] for u in urls]
                assert served == [version] * n, served
                cell = {"engines": n, "method": method, "seconds": [round(t, 3) for t in times],
                        "median_s": round(statistics.median(times), 3),
                        "transfer_s": [round(t, 3) for t in transfers], "median_transfer_s":
                        round(statistics.median(transfers), 3), "apply_s": [round(t, 3) for t in applies],
                        "median_apply_s": round(statistics.median(applies), 3)}
                report["cells"].append(cell)
                print(f"[bench] {n} engines, {method}: {cell['median_s']:.2f} s per update (transfer "
                      f"{cell['median_transfer_s']:.2f}, apply {cell['median_apply_s']:.2f}; {cell['seconds']})",
                      flush=True)
                args.out.write_text(json.dumps(report, indent=2))
    report["scaling"] = {}
    for method in args.methods.split(","):
        cells = [c for c in report["cells"] if c["method"] == method]
        points = [(c["engines"], c["median_transfer_s"]) for c in cells]
        a, b = fit_line(points)
        apply_one = next(c["median_apply_s"] for c in cells if c["engines"] == min(counts))
        report["scaling"][method] = {"transfer_points": points, **projection(a, b, apply_one, model_bytes)}
        print(f"[bench] {method}: transfer {a:.2f} s + {b:.2f} s per engine here; 8B bf16 to 64 replicas: "
              f"transfer ~{report['scaling'][method]['transfer_s_8b_bf16_64_replicas']} s", flush=True)
    report["caveats"] = ("one 2-core host: every engine and the trainer share the cores and the loopback, so "
                         "per-engine costs include CPU contention a cluster does not have; a GPU fleet would "
                         "broadcast with NCCL over NVLink/InfiniBand, not gloo over TCP")
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
