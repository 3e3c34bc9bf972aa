"""Host memory each rank holds for weight sync: before and after shared staging, at TP 1 and 2.

Layouts (``--layouts``): ``private`` (every rank copies every tensor it is sent, the design before;
``"shared_staging": false``), ``shared`` (one shared-memory copy per host that every rank maps, the
default), ``shared-no-rollback`` (the same with ``"policy_rollback": false``: no copy kept after a
commit). For each layout and tensor-parallel size: a ``vllm serve`` of the policy, then two policy
updates through ``EngineClient`` over shared memory and one over HTTP; after each, every rank's
``host_bytes`` (what the plugin holds, from ``/specrl/status``) and its process memory (PSS: shared pages
counted once across the ranks that map them; USS: its own pages). Then the formula and its projection
to 8B and 70B policies at TP 8. Output: JSON. SmolLM2-135M has 9 attention heads, so it serves at TP 1
only; the tiny fixture serves at TP 2.

    python scripts/bench/bench_sync_memory.py --fixtures .fixtures --out results/bench_sync_memory.json
    python scripts/bench/bench_sync_memory.py --fixtures .fixtures --fixture tiny --tp 1,2 --out results/tiny.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors.torch import load_file

from bench_engine import host_info

LAYOUTS = {"private": {"shared_staging": False}, "shared": {}, "shared-no-rollback": {"policy_rollback": False}}
GIB = 2 ** 30


def rank_memory(client) -> list[dict]:
    """Per rank: what the plugin holds for sync and what the process holds."""
    return [{"rank": w["rank"], "host_bytes": w["sync"]["host_bytes"], **w["host_memory"]}
            for w in client.status()["workers"]]


def measure(model: Path, tp: int, layout: str, log: Path) -> dict:
    """Two updates over shared memory, one over HTTP, on a fresh server of ``layout`` at ``tp``."""
    from vllm_specrl.launcher import VLLMServer, cpu_env
    from vllm_specrl.sync.clients.engine_client import EngineClient

    env = dict(cpu_env(), **({"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, range(tp)))} if tp > 1 else {}))
    args = ["--dtype", "bfloat16", "--max-model-len", "512", "--tensor-parallel-size", str(tp),
            "--additional-config", json.dumps({"specrl": LAYOUTS[layout]})]
    policy = load_file(model / "model.safetensors")
    with VLLMServer(model, args, env=env, log_path=log) as srv:
        steps = {"before": rank_memory(EngineClient(srv.url, progress=False))}
        for version, transport in ((1, "shm"), (2, "shm"), (3, "http")):
            client = EngineClient(srv.url, transport=transport, progress=False)
            client.update_policy(policy, version=version)
            steps[f"after_v{version}_{transport}"] = rank_memory(client)
    return {"tp": tp, "layout": layout, "steps": steps,
            "policy_bytes": sum(t.numel() * t.element_size() for t in policy.values()),
            "pss_growth_per_rank": [after["pss"] - before["pss"]
                                    for before, after in zip(steps["before"], steps["after_v3_http"])]}


def eight_heads_like(model: Path, out: Path) -> Path:
    """A model of ``model``'s size and tokenizer whose attention heads divide by 2 and 4 (hidden 512,
    8 heads of 64, 4 KV heads; random bf16 weights: memory, not text, is measured)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "model.safetensors").exists():
        return out
    config = AutoConfig.from_pretrained(model)
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads = 512, 8, 4
    config.head_dim, config.intermediate_size, config.tie_word_embeddings = 64, 1536, True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).save_pretrained(out)
    for path in model.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(path, out / path.name)
    return out


def projection(policy_bytes: float, ranks_per_host: int) -> dict:
    """Host bytes per host held for sync, steady (between updates) and at the peak (staging the next
    update, or committing: the new set and the rollback point), per layout."""
    p, r = policy_bytes, ranks_per_host
    return {"private": {"steady": r * p, "peak": 2 * r * p},
            "shared": {"steady": p, "peak": 2 * p},
            "shared-no-rollback": {"steady": 0, "peak": p}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=None)
    ap.add_argument("--fixture", default="real", choices=["real", "real-8-heads", "tiny"],
                    help="real: SmolLM2-135M (9 heads: TP 1 only); real-8-heads: a model of its size (30 layers, "
                         "127M parameters, bf16) with 8 heads, random weights, which TP 2 serves; tiny: the test "
                         "fixture")
    ap.add_argument("--tp", default="1")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--out", type=Path, default=Path("results/bench_sync_memory.json"))
    args = ap.parse_args()

    from vllm_specrl.fixtures import fixture_target

    model = Path(fixture_target(args.fixture.removesuffix("-8-heads"), args.fixtures))
    if args.fixture == "real-8-heads":
        model = eight_heads_like(model, model.parent / "smollm2-size-8-heads")  # beside the fixture
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "sync_host_memory", "model": str(model), "host": host_info(), "runs": [],
              "projection_bf16_tp8": {name: projection(params * 2, 8) for name, params in (("8B", 8e9), ("70B", 70e9))}}
    for tp in map(int, args.tp.split(",")):
        for layout in args.layouts.split(","):
            run = measure(model, tp, layout, args.out.with_suffix(f".tp{tp}.{layout}.log"))
            report["runs"].append(run)
            held = [r["host_bytes"]["total"] / GIB for r in run["steps"]["after_v3_http"]]
            pss = [g / GIB for g in run["pss_growth_per_rank"]]
            print(f"[sync-memory] TP {tp} {layout}: plugin holds {', '.join(f'{h:.2f}' for h in held)} GiB per rank "
                  f"(policy {run['policy_bytes'] / GIB:.2f} GiB); PSS grew {', '.join(f'{g:.2f}' for g in pss)} GiB",
                  flush=True)
            args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
