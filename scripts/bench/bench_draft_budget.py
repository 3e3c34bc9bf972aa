"""Held-out acceptance against training data, and training objectives compared on the same data.

Reads the rollouts a warm start saved (``warm_start_rollouts.json`` in its draft
directory), computes the target's features once, and trains fresh drafts:
- budgets: the first N training prompts (all their rollouts) for several N, same
  steps, same held-out prompts: held-out served acceptance vs completion tokens;
- objectives (``--objectives``): soft CE and terms added to it (``ce+wd0.5+tv4``: weight decay, TV term,
  acceptance-weighted TTT, feature noise, the TTT steps' decay, decay toward the starting weights);
- starts (``--target-layers none,last``): a fresh draft's decoder layer from random weights or
  from a target layer (``train-draft --target-layer``), full budget;
- ``--init-from DRAFT``: every run fine-tunes that draft instead of a fresh one (what the online
  trainer does to a warm-started draft), and the report starts with the draft's own held-out figure.
Every figure is the trainer's estimate of vLLM's counters on held-out prompts
(``served_accept_pos*``), which ``bench_calibration.py`` checks against the engine.
JSON + PNG.

    python scripts/bench/bench_draft_budget.py --target .fixtures/real/target \\
        --rollouts .fixtures/real/drafts/warm-arithmetic/warm_start_rollouts.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from pathlib import Path

import torch

# An objective is soft CE plus terms joined by "+": "ce+wd0.5+tv4" is soft CE with weight decay 0.5 and
# the TV term at weight 4; "decay0.6" weights TTT step k by 0.6**k instead of the default 0.8**k;
# "anchor1" decays toward the starting weights instead of zero (TrainConfig.start_anchor).
# A term is its name, or its name and a number (the bare name takes the default).
OBJECTIVE_TERMS = {"tv": ("tv_weight", 1.0), "accept_weighted": ("accept_weighted", True),
                   "noise": ("feature_noise", 0.2), "wd": ("weight_decay", 0.5),
                   "decay": ("decay", 0.8), "anchor": ("start_anchor", 0.5)}


def parse_objective(name: str) -> dict:
    """TrainConfig overrides for an objective name such as ``ce+wd0.5+tv4``; ValueError on an unknown term."""
    terms = name.split("+")
    if terms[0] != "ce":
        raise ValueError(f"objective {name!r}: must start with 'ce' (soft cross-entropy)")
    out: dict = {}
    for term in terms[1:]:
        key = next((k for k in OBJECTIVE_TERMS if term.startswith(k)), None)
        if key is None:
            raise ValueError(f"objective {name!r}: unknown term {term!r} (known: {', '.join(OBJECTIVE_TERMS)})")
        field, default = OBJECTIVE_TERMS[key]
        number = term[len(key):]
        if number and isinstance(default, bool):
            raise ValueError(f"objective {name!r}: {key} takes no number")
        if field in out:
            raise ValueError(f"objective {name!r}: {key} given twice")
        out[field] = float(number) if number else default
    return out


def train_one(target: Path, features: list[dict], counts: torch.Tensor, train_idx: list[int],
              eval_items: list[dict], args: argparse.Namespace, objective: dict,
              target_layer: int | None = None, seed: int = 0, save_to: Path | None = None,
              train_prompt_texts: list[str] | None = None) -> dict:
    """Train one draft and return its held-out estimate; ``save_to``: also save it, servable, with the
    prompts it trained on in its metadata (``bench_calibration.py`` holds those out)."""
    from vllm_specrl.proposer.checkpoint import init_draft, load_draft, target_lm_head
    from vllm_specrl.trainer.core import DraftTrainer, TrainConfig, collate
    from vllm_specrl.trainer.offline import training_batches

    draft = (load_draft(args.init_from, target) if args.init_from
             else init_draft(target, None, args.draft_vocab_size, token_counts=counts, seed=seed,
                             target_layer=target_layer))
    cfg = TrainConfig(lr=args.lr, ttt_steps=args.k, seed=seed, mixed_precision=args.mixed_precision,
                      lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps, total_steps=args.steps,
                      **objective)
    trainer = DraftTrainer(draft, target_lm_head(target), cfg)
    rng = random.Random(seed)
    items = [features[i] for i in train_idx]
    batches = training_batches(items, args.batch_size, rng, args.group_by_length)
    t0 = time.time()
    for _ in range(args.steps):
        trainer.step(collate(next(batches)))
    seconds = time.time() - t0
    m = trainer.evaluate_many(eval_items)
    row = {"per_position": [m[f"served_accept_pos{j}"] for j in range(args.k)],
           "acceptance_length": m["served_acceptance_length"], "train_seconds": round(seconds, 1),
           "completion_tokens": sum(len(f["token_ids"]) - f["first_draft"] - 1 for f in items),
           "rollouts": len(items)}
    if save_to is not None:
        trainer.save(save_to, extra={"warm_start": {"train_prompt_texts": train_prompt_texts or [],
                                                    "bench_draft_budget": {**objective, **row}}})
        row["saved_to"] = str(save_to)
    return row


def main() -> None:
    from transformers import AutoModelForCausalLM

    from vllm_specrl.cli.drafts import parse_target_layer
    from vllm_specrl.host import host_info
    from vllm_specrl.proposer.checkpoint import load_draft, target_lm_head
    from vllm_specrl.proposer.eagle3_config import default_aux_layer_ids, read_config
    from vllm_specrl.trainer.core import DraftTrainer, TrainConfig
    from vllm_specrl.trainer.features import sequence_features

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--rollouts", type=Path, required=True)
    ap.add_argument("--budgets", default="0.25,0.5,1.0", help="fractions of the training prompts")
    ap.add_argument("--objectives", default="ce",
                    help="comma list of objectives, each ce[+term...], terms tv[W], accept_weighted, noise[S], "
                         "wd[D], decay[G], anchor[A] (full budget)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
    ap.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine"])
    ap.add_argument("--seeds", default="0",
                    help="comma list: each objective is trained once per seed (the draft's initial weights, batch "
                         "order and feature noise), so a difference can be read against the seeds' spread")
    ap.add_argument("--group-by-length", action="store_true", help="batches as train-draft --group-by-length makes")
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--start", default="none",
                    help="the budgets' and objectives' fresh-draft start: none (random), last or a layer index")
    ap.add_argument("--target-layers", default="",
                    help="comma list of fresh-draft starts to compare (none, last or a layer index), full budget")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="fine-tune this draft in every run instead of training a fresh one")
    ap.add_argument("--save-drafts", type=Path, default=None,
                    help="save each objective's draft under DIR/<objective>-s<seed>, servable, so that "
                         "bench_calibration.py can serve the very drafts the screen compared")
    ap.add_argument("--out", type=Path, default=Path("results/bench_draft_budget.json"))
    args = ap.parse_args()
    objectives = {o: parse_objective(o) for o in args.objectives.split(",") if o}  # fail before the features

    data = json.loads(args.rollouts.read_text())
    seqs, lengths, index = data["sequences"], data["prompt_lengths"], data["prompt_index"]
    eval_prompts = set(data["eval_prompts"])
    train_prompts = sorted(set(index) - eval_prompts)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    # A draft to fine-tune reads the target layers it was trained on; a fresh one the default ones.
    initial = load_draft(args.init_from, args.target) if args.init_from else None
    aux = (initial.shape.aux_layer_ids if initial is not None
           else default_aux_layer_ids(read_config(args.target)["num_hidden_layers"]))
    t0 = time.time()
    features = sequence_features(target, seqs, aux, prompt_lengths=lengths)
    feature_seconds = time.time() - t0
    del target
    eval_items = [f for f, i in zip(features, index) if i in eval_prompts]
    vocab = read_config(args.target)["vocab_size"]
    report = {"target": str(args.target), "rollouts": str(args.rollouts), "steps": args.steps,
              "batch_size": args.batch_size, "lr": args.lr, "lr_schedule": args.lr_schedule,
              "warmup_steps": args.warmup_steps, "start": args.start,
              "group_by_length": args.group_by_length, "k": args.k, "eval_rollouts": len(eval_items),
              "feature_seconds": round(feature_seconds, 1), "host": host_info(), "budgets": [], "objectives": [],
              "starts": []}
    if initial is not None:
        m = DraftTrainer(initial, target_lm_head(args.target), TrainConfig(ttt_steps=args.k)).evaluate_many(eval_items)
        report["init_from"] = {"draft": str(args.init_from), "acceptance_length": m["served_acceptance_length"],
                               "per_position": [m[f"served_accept_pos{j}"] for j in range(args.k)]}
        print(json.dumps(report["init_from"]), flush=True)

    def counts_for(prompt_ids: set[int]) -> torch.Tensor:
        c = Counter(t for s, n, i in zip(seqs, lengths, index) if i in prompt_ids for t in s[n:])
        out = torch.zeros(vocab)
        for tok, n in c.items():
            out[tok] = n
        return out

    for fraction in [float(x) for x in args.budgets.split(",") if x]:
        chosen = set(train_prompts[: max(1, round(fraction * len(train_prompts)))])
        idx = [j for j, i in enumerate(index) if i in chosen]
        row = {"fraction": fraction, "prompts": len(chosen),
               **train_one(args.target, features, counts_for(chosen), idx, eval_items, args, {},
                           parse_target_layer(args.start))}
        report["budgets"].append(row)
        print(json.dumps(row), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    all_idx = [j for j, i in enumerate(index) if i in set(train_prompts)]
    train_texts = [data["prompts"][i] for i in train_prompts]
    for name, seed in [(o, int(s)) for o in objectives for s in args.seeds.split(",")]:
        save_to = args.save_drafts / f"{name}-s{seed}" if args.save_drafts else None
        row = {"objective": name, "seed": seed,
               **train_one(args.target, features, counts_for(set(train_prompts)), all_idx, eval_items, args,
                           objectives[name], parse_target_layer(args.start), seed, save_to, train_texts)}
        report["objectives"].append(row)
        print(json.dumps(row), flush=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    for start in [x for x in args.target_layers.split(",") if x]:
        row = {"target_layer": start, **train_one(args.target, features, counts_for(set(train_prompts)), all_idx,
                                                  eval_items, args, {}, parse_target_layer(start))}
        report["starts"].append(row)
        print(json.dumps(row), flush=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if report["budgets"]:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["completion_tokens"] for r in report["budgets"]]
        ax.plot(xs, [r["acceptance_length"] for r in report["budgets"]], "o-", label="acceptance length")
        for j in range(args.k):
            ax.plot(xs, [r["per_position"][j] for r in report["budgets"]], "--", label=f"accepted at pos {j}")
        ax.set_xscale("log")
        ax.set_xlabel("completion tokens in the training rollouts")
        ax.set_title(f"held-out served estimate, k={args.k}, {args.steps} steps")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=110)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
