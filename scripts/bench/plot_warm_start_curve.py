"""Plot a warm start's held-out learning curve (``--eval-every``) from its trainer_meta.json.

Each point is the trainer's estimate of vLLM's served counters on the held-out prompts
(``served_accept_pos*``) against completion tokens trained on so far. JSON + PNG.

    python scripts/bench/plot_warm_start_curve.py .fixtures/real/drafts/warm-arithmetic --out benchmarks/cpu/x.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("draft", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    meta = json.loads((args.draft / "trainer_meta.json").read_text())["warm_start"]
    curve = meta["curve"]
    k = sum(1 for key in curve[0] if key.startswith("served_accept_pos"))
    report = {"draft": str(args.draft), "rollouts": meta["rollouts"],
              "completion_tokens_in_data": meta["completion_tokens"], "train_prompts": meta["train_prompts"],
              "eval_prompts": meta["eval_prompts"], "seconds": meta["seconds"], "curve": curve}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [c["completion_tokens"] for c in curve]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [c["served_acceptance_length"] for c in curve], "o-", label="acceptance length")
    for j in range(k):
        ax.plot(xs, [c[f"served_accept_pos{j}"] for c in curve], "--", label=f"accepted at position {j}")
    ax.axhline(2.0, color="grey", lw=0.5)
    ax.set_xlabel("completion tokens trained on")
    ax.set_title("held-out estimate of vLLM's acceptance (k=%d)" % k)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
