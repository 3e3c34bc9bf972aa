"""What cutting each sequence's draft where the draft is unsure could serve, estimated from rollouts.

vLLM verifies every token a drafter proposes, and on a CPU a verified row is a real share of a step
(``bench_step_cost.py``: at 16 sequences each drafted position adds about a fifth of a plain step)
while the third drafted token is accepted a fraction of the time. A drafter that ends a sequence's
draft at the first token it is unsure of verifies fewer rows and stays lossless (the cut reads only the
draft's side: what is verified is still accepted by vLLM's rejection sampler). Before building that
into the engine, this bounds it from the held-out rollouts the trainer's served estimate uses (that
estimate has matched vLLM's counters within 0.01-0.02), for two rules:

- ``tau``: draft token ``j`` is verified while every sampled token so far had draft probability
  ``q_i(x_i) >= tau``;
- ``theta``: while the running product ``prod q_i(x_i) >= theta`` (EAGLE-2's rule for its tree).

Gain side (exact in expectation): the accepted tokens. A drafted token is accepted only if it equals
the token the rollout emitted, so ``P(step j accepted and verified | emitted y) = min(1, q/p)(y) *
[rule holds along y]`` with ``q`` the teacher-forced draft distribution the trainer's unroll computes.
Cost side (approximate): the verified rows, ``E[rule holds]`` over tokens sampled from the draft's
teacher-forced distributions (Monte Carlo), which is exact where earlier steps were accepted and a
stand-in where the draft ran off the rollout. The walk over draft starts is vLLM's (``n`` accepted:
next start ``s + n + 1``), from ``bench_hybrid_estimate``.

With ``--step-cost`` (a ``bench_step_cost.py`` JSON of this CPU) each policy's generation time per token
against plain is projected per batch size: a step's drafting as measured at its loop's k (the draft runs
every step for the batch; at one sequence it stops at the cut), its verification on a line fitted to
the measured steps' rows (target forward, logits, rejection sampling and the rest of the step).

    python scripts/bench/bench_draft_cut_estimate.py --draft .fixtures/real/drafts/demo-explain-quick \\
        --step-cost benchmarks/cpu/bench_step_cost_demo_bf16_amd512.json --out results/draft_cut_estimate.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from bench_hybrid_estimate import pooled, walk


def draft_features(target: Path, draft: Path, sequences: list[list[int]], prompt_lengths: list[int], k: int,
                   samples: int, batch_size: int = 16, seed: int = 0) -> tuple[list[dict[str, np.ndarray]], float]:
    """Per sequence: ``valid`` / ``weight`` [k, n] as ``bench_hybrid_estimate.eagle_weights``, ``conf`` [k, n]
    the draft's probability of the emitted token (past a rollout's end, where the token is unknown: of its
    own likeliest), ``sampled`` [k, n, samples] its probabilities of tokens sampled from it; and the
    trainer's pooled served estimate over the same unroll (to check the walk against)."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_specrl.proposer.checkpoint import load_draft, target_lm_head
    from vllm_specrl.trainer.acceptance import pool, served_acceptance
    from vllm_specrl.trainer.core import DraftTrainer, TrainConfig, collate
    from vllm_specrl.trainer.features import sequence_features

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    head = target_lm_head(target).float()
    drafter = load_draft(draft, target)
    features = sequence_features(model, sequences, drafter.shape.aux_layer_ids, dtype=torch.float32,
                                 prompt_lengths=prompt_lengths)
    del model
    trainer = DraftTrainer(drafter, head, TrainConfig(ttt_steps=k))
    ids = trainer.unwrapped.draft_token_ids()
    slot_of = torch.full((int(ids.max()) + 1,), -1, dtype=torch.long)
    slot_of[ids] = torch.arange(len(ids))
    gen = torch.Generator().manual_seed(seed)
    out, parts = [], []
    for i in range(0, len(features), batch_size):
        chunk = features[i:i + batch_size]
        batch = collate(chunk)
        steps = trainer.acceptance(batch)
        parts.append(served_acceptance(steps, batch.first))
        logits = trainer.draft_logits(batch)
        t = batch.token_ids.shape[1]
        conf = torch.zeros(k, len(chunk), t)
        top = torch.zeros(k, len(chunk), t)
        alpha = torch.zeros(k, len(chunk), t)
        sampled = torch.zeros(k, len(chunk), t, samples)
        # The target's distribution over the draft vocabulary at every row (row r: of token r + 1).
        p_rows = torch.zeros(len(chunk), t, len(ids))
        for b, f in enumerate(chunk):
            n = len(f["token_ids"])
            p_rows[b, :n] = (f["final_hidden"].float() @ head[ids].T - f["target_lse"][:, None]).exp()
        for j, step_logits in enumerate(logits):
            q = step_logits.float().softmax(-1)                      # [B, T, Vd]
            top[j] = q.amax(-1)
            # Step j at base r drafts the token at r + 2 + j, from the target's row r + 1 + j.
            shifted = torch.zeros_like(p_rows)
            shifted[:, :t - 1 - j] = p_rows[:, 1 + j:]
            alpha[j] = torch.minimum(q, shifted).sum(-1)
            nxt = batch.token_ids[:, (torch.arange(t) + 2 + j).clamp(max=t - 1)]
            slot = slot_of[nxt.clamp(max=len(slot_of) - 1)].where(nxt < len(slot_of), torch.tensor(-1))
            q_emitted = q.gather(-1, slot.clamp(min=0)[..., None])[..., 0] * (slot >= 0)
            emitted = (torch.arange(t)[None, :] + 2 + j) < batch.lengths[:, None]
            conf[j] = torch.where(emitted, q_emitted, q.amax(-1))
            flat = q.reshape(-1, q.shape[-1])
            rows = flat.sum(-1) > 0                                   # rows the unroll left at 0 stay 0
            draws = torch.zeros(flat.shape[0], samples, dtype=torch.long)
            draws[rows] = torch.multinomial(flat[rows], samples, replacement=True, generator=gen)
            sampled[j] = flat.gather(-1, draws).reshape(len(chunk), t, samples) * rows.reshape(len(chunk), t, 1)
        for b, f in enumerate(chunk):
            n = len(f["token_ids"])
            out.append({"valid": np.stack([v[b, :n].cpu().numpy() for v in steps.valid]),
                        "weight": np.stack([w[b, :n].float().cpu().numpy() for w in steps.accept_weight]),
                        "conf": conf[:, b, :n].numpy(), "sampled": sampled[:, b, :n].numpy(),
                        "top": top[:, b, :n].numpy(), "alpha": alpha[:, b, :n].numpy()})
    return out, float(pool(parts)["acceptance_length"])


def holds(values: np.ndarray, rule: str, level: float) -> np.ndarray:
    """Whether the rule still lets step j be verified, given the draft's probabilities along the draft
    (axis 0: steps; any further axes: starts, samples)."""
    if rule == "tau":
        return np.cumprod(values >= level, axis=0).astype(bool)
    if rule == "theta":
        return np.cumprod(values, axis=0) >= level
    raise ValueError(rule)


FEATURES = ("sampled", "top", "alpha")


def cut_source(f: dict[str, np.ndarray], rule: str | None, level: float, k_loop: int, feature: str = "sampled"):
    """A ``walk`` source: the draft cut by the rule (None: drafted to ``k_loop`` throughout), with the
    expected verified rows and the draft forwards the start runs if the loop stops at the cut. The rule
    reads ``feature``: ``sampled``, the draft's probability of the token it drew (the gain side reads it
    for the emitted token, the cost side for Monte Carlo draws); ``top``, the draft's largest probability;
    ``alpha``, the expected acceptance ``sum min(p, q)`` (it reads the target: an oracle no drafter has,
    the bound on any rule that predicts acceptance from the draft's side)."""
    k = f["valid"].shape[0]

    def at(s: int):
        valid = f["valid"][:, s].copy()
        valid[k_loop:] = False
        if rule is None:
            n = float(valid.sum())
            return valid, f["weight"][:, s], "eagle", {"rows": n, "draft_steps": n}
        if feature == "sampled":
            valid &= holds(f["conf"][:k, s], rule, level)
            kept = holds(f["sampled"][:k, s], rule, level) & f["valid"][:, s, None]   # [k, samples]
        else:
            valid &= holds(f[feature][:k, s], rule, level)
            kept = valid[:, None]
        kept[k_loop:] = False
        rows = kept.sum(0)
        # The loop samples one token past the cut to see it (unless the cut is at its end).
        steps = np.minimum(rows + 1, min(k_loop, int(f["valid"][:, s].sum())))
        return valid, f["weight"][:, s], "eagle", {"rows": float(rows.mean()), "draft_steps": float(steps.mean())}
    return at


def step_cost_model(path: Path) -> dict[int, dict[str, object]]:
    """Per batch size from a ``bench_step_cost.py`` JSON (rounds averaged): plain's ms per step, the
    drafter's ms per step at each k (``propose``), and a line ms = a + r * rows for the rest of a
    speculative step over its verified rows (batch * (1 + k))."""
    data = json.loads(path.read_text())
    by: dict[tuple[int, str], list[dict]] = {}
    for row in data["rows"]:
        name = row["name"].split("#")[0]
        by.setdefault((row["batch_size"], name), []).append(row["ms_per_step"])
    out: dict[int, dict[str, object]] = {}
    for b in sorted({key[0] for key in by}):
        plain = by.get((b, "plain"))
        spec = {int(n.split("_k")[1].split("_")[0]): r for (bb, n), r in by.items()
                if bb == b and n.startswith("eagle3_k") and "fast" in n}
        if not plain or len(spec) < 2:
            continue
        mean = lambda rows, key: float(np.mean([r[key] for r in rows]))  # noqa: E731
        propose = {kk: mean(rows, "propose") for kk, rows in spec.items()}
        xs = np.array([b * (1 + kk) for kk in spec])
        ys = np.array([mean(rows, "step") - propose[kk] for kk, rows in spec.items()])
        r, a = np.polyfit(xs, ys, 1)
        out[b] = {"plain_ms": mean(plain, "step"), "propose_ms": propose, "verify_a_ms": float(a),
                  "verify_ms_per_row": float(r)}
    return out


def projected_ratio(cost: dict[str, object], batch: int, row: dict[str, float], k_loop: int,
                    loop_stops_at_cut: bool) -> float:
    """Generation time per token against plain at this batch size, for a policy's pooled walk."""
    propose = cost["propose_ms"]
    ks = sorted(propose)
    steps = row["draft_steps_per_step"] if loop_stops_at_cut else float(k_loop)
    draft_ms = float(np.interp(steps, ks, [propose[k] for k in ks])) if steps >= ks[0] else \
        propose[ks[0]] * steps / ks[0]
    step_ms = draft_ms + cost["verify_a_ms"] + cost["verify_ms_per_row"] * batch * (1.0 + row["rows_per_step"])
    return (step_ms / (batch * row["tokens_per_step"])) / (cost["plain_ms"] / batch)


def held_out_rollouts(draft: Path, rollouts: Path | None, limit: int) -> tuple[list[list[int]], list[int]]:
    """The rollouts of prompts the draft did not train on (its warm-start file's ``eval_prompts``)."""
    saved = json.loads((rollouts or draft / "warm_start_rollouts.json").read_text())
    trained = set(json.loads((draft / "trainer_meta.json").read_text())["warm_start"]["train_prompt_texts"])
    held_out = {p for p in saved["eval_prompts"] if saved["prompts"][p] not in trained}
    picked = [i for i, p in enumerate(saved["prompt_index"]) if p in held_out][:limit]
    if not picked:
        raise SystemExit("no held-out rollouts: every prompt of these rollouts was trained on")
    return [saved["sequences"][i] for i in picked], [saved["prompt_lengths"][i] for i in picked]


def main() -> None:
    from vllm_specrl.host import host_info

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path(".fixtures/real/target"))
    ap.add_argument("--draft", type=Path, default=Path(".fixtures/real/drafts/demo-explain-quick"))
    ap.add_argument("--rollouts", type=Path, default=None,
                    help="a warm_start_rollouts.json (default: the draft's own; its held-out prompts are used)")
    ap.add_argument("--max-rollouts", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="the longest draft (the loop's k)")
    ap.add_argument("--samples", type=int, default=16, help="Monte Carlo draws per start for the rows' cost")
    ap.add_argument("--taus", default="0.05,0.1,0.2,0.3,0.5")
    ap.add_argument("--thetas", default="0.02,0.05,0.1,0.2,0.3,0.5")
    ap.add_argument("--step-cost", type=Path, default=None, help="a bench_step_cost.py JSON of this CPU")
    ap.add_argument("--out", type=Path, default=Path("results/draft_cut_estimate.json"))
    args = ap.parse_args()

    sequences, prompt_lengths = held_out_rollouts(args.draft, args.rollouts, args.max_rollouts)
    t0 = time.perf_counter()
    feats, trainer_served = draft_features(args.target, args.draft, sequences, prompt_lengths, args.k, args.samples)
    seconds = time.perf_counter() - t0

    def run(rule: str | None, level: float, k_loop: int, feature: str = "sampled") -> dict[str, object]:
        parts = [walk(len(sequences[i]), prompt_lengths[i] - 1, args.k,
                      cut_source(feats[i], rule, level, k_loop, feature)) for i in range(len(sequences))]
        row = pooled(parts)
        steps = sum(p["steps"] for p in parts)
        row["rows_per_step"] = sum(p["rows"] for p in parts) / steps
        row["draft_steps_per_step"] = sum(p["draft_steps"] for p in parts) / steps
        for key in ("history_share_of_drafts",):
            row.pop(key)
        return row

    policies = {f"k={kk}": (None, 0.0, kk, "sampled") for kk in range(1, args.k + 1)}
    for feature in FEATURES:
        policies.update({f"{feature}:tau={x}": ("tau", float(x), args.k, feature) for x in args.taus.split(",")})
        policies.update({f"{feature}:theta={x}": ("theta", float(x), args.k, feature)
                         for x in args.thetas.split(",")})
    rows = {name: run(*spec) for name, spec in policies.items()}
    costs = step_cost_model(args.step_cost) if args.step_cost else {}
    for name, row in rows.items():
        rule, _, k_loop, _ = policies[name]
        row["projected_vs_plain"] = {
            str(b): round(projected_ratio(c, b, row, k_loop, loop_stops_at_cut=(b == 1 and rule is not None)), 4)
            for b, c in costs.items()}
    report = {"draft": str(args.draft), "k": args.k, "held_out_rollouts": len(sequences),
              "samples": args.samples, "trainer_served_estimate": trainer_served,
              "features_seconds": round(seconds, 1), "step_cost": str(args.step_cost) if args.step_cost else None,
              "step_cost_model": {str(b): c for b, c in costs.items()}, "host": host_info(), "policies": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=float) + "\n")
    print(f"trainer's served estimate: {trainer_served:.3f} ({len(sequences)} held-out rollouts)")
    for name, row in rows.items():
        proj = "  ".join(f"b{b} {v:.3f}" for b, v in row["projected_vs_plain"].items())
        print(f"{name:18s} AL {row['acceptance_length']:.3f}  tokens/step {row['tokens_per_step']:.3f}  "
              f"rows/step {row['rows_per_step']:.3f}  draft steps {row['draft_steps_per_step']:.2f}  {proj}")


if __name__ == "__main__":
    main()
