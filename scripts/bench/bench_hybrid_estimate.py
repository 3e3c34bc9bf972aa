"""What a hybrid of the history proposer and EAGLE-3 could serve, estimated from rollouts.

A hybrid drafts from the rollout history where it has a match (GRPO siblings, earlier
epochs of the same prompt) and from the EAGLE-3 draft elsewhere. Before building it
into the engine, this bounds what it can gain, from the same held-out rollouts the
trainer's served estimate uses (``trainer.acceptance``: that estimate has matched
vLLM's counters within 0.01-0.02):

- EAGLE-3: per draft start ``s`` and step ``j`` the probability that step ``j`` is
  accepted given the token the rollout emitted there (``min(1, q / p)``), from the
  trainer's unroll over target features of an HF forward;
- history: its token-id draft at ``s`` from the real ``HistoryIndex`` (the rollout's
  own text, its G - 1 siblings up to the same completion length, as a GRPO group
  generates them together, and optionally rollouts of an earlier epoch kept at one
  policy version behind). vLLM accepts a token-id draft with the target's probability
  of it, which is the probability that a target sample equals it, so the count of
  leading draft tokens that equal the rollout's is an unbiased estimate;
- a walk over draft starts as vLLM makes them (``n`` accepted: next start ``s + n + 1``;
  no draft: one token), per policy: EAGLE-3 only, history only, the hybrid (history
  where its draft at a confidence threshold is non-empty, else EAGLE-3), and an
  oracle that picks the better source per start from the outcome (an upper bound,
  not a policy). Reported as vLLM counts them (acceptance length over drafts) and
  as tokens per verify step.

    python scripts/bench/bench_hybrid_estimate.py --draft .fixtures/real/drafts/demo-explain \\
        --target .fixtures/real/target --out benchmarks/cpu/hybrid_estimate.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def eagle_weights(target: Path, draft: Path, sequences: list[list[int]], prompt_lengths: list[int], k: int,
                  batch_size: int = 16) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], float]:
    """Per sequence ([k, n] valid, [k, n] acceptance weight) of the EAGLE-3 draft and [n] the target's
    probability of each next token (row t: of token t + 1), and the trainer's own pooled served
    estimate (to check the walk here against)."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_specrl.proposer.checkpoint import load_draft, target_lm_head
    from vllm_specrl.trainer.acceptance import pool, served_acceptance
    from vllm_specrl.trainer.core import DraftTrainer, TrainConfig, collate
    from vllm_specrl.trainer.features import sequence_features

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    drafter = load_draft(draft, target)
    features = sequence_features(model, sequences, drafter.shape.aux_layer_ids, dtype=torch.float32,
                                 prompt_lengths=prompt_lengths)
    del model
    head = target_lm_head(target).float()
    p_next = []
    for f in features:
        ids = f["token_ids"]
        logit = (f["final_hidden"][:-1].float() * head[ids[1:]]).sum(-1)
        p_next.append(np.append((logit - f["target_lse"][:-1]).exp().numpy(), 0.0))
    trainer = DraftTrainer(drafter, head, TrainConfig(ttt_steps=k))
    valid, weight, parts = [], [], []
    for i in range(0, len(features), batch_size):
        chunk = features[i:i + batch_size]
        batch = collate(chunk)
        steps = trainer.acceptance(batch)
        parts.append(served_acceptance(steps, batch.first))   # as evaluate_many pools it, from the same unroll
        for b, f in enumerate(chunk):
            n = len(f["token_ids"])
            valid.append(np.stack([v[b, :n].cpu().numpy() for v in steps.valid]))
            weight.append(np.stack([w[b, :n].float().cpu().numpy() for w in steps.accept_weight]))
    return valid, weight, p_next, float(pool(parts)["acceptance_length"])


def history_drafts(groups: list[list[int]], kept: dict[int, list[int]], sequences: list[list[int]],
                   prompt_lengths: list[int], p_next: list[np.ndarray], k: int, thresholds: list[float],
                   sampled: bool) -> dict[float, list[tuple[np.ndarray, np.ndarray]]]:
    """Per threshold, per sequence, ([k, n] valid, [k, n] acceptance weight) of the history's draft at
    each start: token-id drafts (the heaviest tokens; weight 1 while they equal the rollout's) or
    sampled ones (``min(1, q(x) / p(x))`` for the emitted token x, q the continuations' shares)."""
    from vllm_specrl.proposer.history_index import HistoryConfig, HistoryIndex

    out: dict[float, list] = {c: [None] * len(p_next) for c in thresholds}
    for g, members in enumerate(groups):
        index = HistoryIndex(HistoryConfig(cost_aware=False, sample_drafts=sampled))
        prompt = np.asarray(sequences[members[0]][:prompt_lengths[members[0]]], dtype=np.int32)
        key, _ = index.group(prompt)
        for n, other in enumerate(kept.get(g, [])):
            index.add_completion(key, np.asarray(sequences[other][prompt_lengths[other]:], dtype=np.int32), 0,
                                 f"kept-{n}")
        index.set_policy_version(1)
        tail = max(len(prompt) - index.cfg.prompt_tail, 0)
        for own in members:
            seq, plen = np.asarray(sequences[own], dtype=np.int32), prompt_lengths[own]
            siblings = [m for m in members if m != own]
            tables = {c: (np.zeros((k, len(seq)), dtype=bool), np.zeros((k, len(seq)))) for c in thresholds}
            for s in range(plen - 1, len(seq) - 2):
                done = s + 2 - plen   # completion tokens so far (the context is seq[:s + 2])
                live = [seq[tail:s + 2]] + [np.asarray(sequences[m][tail:prompt_lengths[m] + done], dtype=np.int32)
                                            for m in siblings]
                corpus = index.corpus(key, live)
                context, truth = seq[:s + 2][-index.cfg.max_match:], seq[s + 2:s + 2 + k]
                for c in thresholds:
                    valid, weight = tables[c]
                    if sampled:
                        for j, (ids, q) in enumerate(index.shares_along(corpus, context, truth, k, c)):
                            hit = np.flatnonzero(ids == truth[j])
                            valid[j, s] = True
                            weight[j, s] = min(1.0, float(q[hit[0]]) / max(float(p_next[own][s + 1 + j]), 1e-12)) \
                                if len(hit) else 0.0
                    else:
                        draft = index.draft(corpus, context, k, None, c).tokens
                        valid[:len(draft), s] = True
                        for j, token in enumerate(draft):
                            if j >= len(truth) or token != truth[j]:
                                break
                            weight[j, s] = 1.0
            for c in thresholds:
                out[c][own] = tables[c]
    return out


def walk(n: int, first: int, k: int, source) -> dict[str, float]:
    """Expected vLLM counters over one rollout: ``source(s)`` gives (valid [k] bool, weights [k], tag), or
    with a fourth element a dict of per-start costs (e.g. expected verified rows) summed as expectations."""
    mass = np.zeros(n + k + 3)
    mass[first] = 1.0
    c = {"drafts": 0.0, "steps": 0.0, "tokens": 0.0, "history_drafts": 0.0, "accepted": np.zeros(k)}
    for s in range(first, n):
        m = mass[s]
        if m == 0.0 or s + 2 >= n:   # the token at s + 1 was the rollout's last: done
            continue
        valid, weights, tag, *costs = source(s)
        for name, value in (costs[0] if costs else {}).items():
            c[name] = c.get(name, 0.0) + m * value
        c["steps"] += m
        if not valid[0]:
            mass[s + 1] += m
            c["tokens"] += m
            continue
        c["drafts"] += m
        c["history_drafts"] += m * (tag == "history")
        chain = 1.0
        for j in range(k + 1):
            drafted = j < k and bool(valid[j])
            p_stop = chain * (1.0 - weights[j]) if drafted else chain
            mass[s + j + 1] += m * p_stop
            c["tokens"] += m * p_stop * (j + 1)
            if not drafted:
                break
            chain *= weights[j]
            c["accepted"][j] += m * chain
    return c


def pooled(parts: list[dict]) -> dict[str, object]:
    drafts = sum(p["drafts"] for p in parts)
    accepted = sum(p["accepted"] for p in parts)
    steps, tokens = sum(p["steps"] for p in parts), sum(p["tokens"] for p in parts)
    per_pos = [float(a / drafts) if drafts else 0.0 for a in accepted]
    return {"acceptance_length": 1.0 + sum(per_pos), "per_position": [round(a, 4) for a in per_pos],
            "tokens_per_step": tokens / steps, "history_share_of_drafts": sum(p["history_drafts"] for p in parts)
            / drafts if drafts else 0.0, "drafts": drafts, "steps": steps}


def main() -> None:
    from vllm_specrl.host import host_info

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path(".fixtures/real/target"))
    ap.add_argument("--draft", type=Path, default=Path(".fixtures/real/drafts/demo-explain"),
                    help="an EAGLE-3 draft built by train-draft (its warm_start_rollouts.json held-out prompts)")
    ap.add_argument("--rollouts", type=Path, default=None,
                    help="a warm_start_rollouts.json to estimate on (default: the draft's own); its held-out "
                         "prompts must not be among those the draft trained on")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=4, help="GRPO's G: rollouts of a prompt generated together")
    ap.add_argument("--kept-epochs", type=int, default=0,
                    help="earlier epochs' groups of the same prompt kept in the history (one version behind)")
    ap.add_argument("--groups-per-prompt", type=int, default=4)
    ap.add_argument("--history-drafts", default="token", choices=["token", "sampled"],
                    help="the history's heaviest tokens (as for greedy requests) or sampled ones (T > 0, its default)")
    ap.add_argument("--thresholds", default="0.25,0.4,0.5,0.6,0.7,0.8")
    ap.add_argument("--out", type=Path, default=Path("results/bench_hybrid_estimate.json"))
    args = ap.parse_args()
    thresholds = [float(x) for x in args.thresholds.split(",")]

    saved = json.loads((args.rollouts or args.draft / "warm_start_rollouts.json").read_text())
    held_out = set(saved["eval_prompts"])
    trained = set(json.loads((args.draft / "trainer_meta.json").read_text())["warm_start"]["train_prompt_texts"])
    seen = sorted(saved["prompts"][p] for p in held_out if saved["prompts"][p] in trained)
    if seen:
        raise SystemExit(f"the draft trained on held-out prompts of these rollouts: {seen}")
    by_prompt: dict[int, list[int]] = {}
    for i, p in enumerate(saved["prompt_index"]):
        if p in held_out:
            by_prompt.setdefault(p, []).append(i)
    g_size, per_prompt = args.group_size, args.groups_per_prompt
    need = g_size * (per_prompt + args.kept_epochs)
    short = {p: len(v) for p, v in by_prompt.items() if len(v) < need}
    if short:
        raise SystemExit(f"held-out prompts with fewer than {need} rollouts: {short}")
    picked: list[int] = []
    groups: list[list[int]] = []
    kept_src: dict[int, list[int]] = {}
    for p in sorted(by_prompt):
        rows = by_prompt[p]
        for g in range(per_prompt):
            members = rows[g * g_size:(g + 1) * g_size]
            base = len(picked)
            picked += members
            groups.append(list(range(base, base + g_size)))
            extra = rows[per_prompt * g_size:per_prompt * g_size + args.kept_epochs * g_size]
            kept_src[len(groups) - 1] = extra
    sequences = [saved["sequences"][i] for i in picked]
    prompt_lengths = [saved["prompt_lengths"][i] for i in picked]
    # Kept rollouts are addressed by their index in the saved file: append them after the picked ones.
    all_sequences, all_lengths = list(sequences), list(prompt_lengths)
    kept: dict[int, list[int]] = {}
    for g, rows in kept_src.items():
        kept[g] = []
        for i in rows:
            kept[g].append(len(all_sequences))
            all_sequences.append(saved["sequences"][i])
            all_lengths.append(saved["prompt_lengths"][i])

    t0 = time.perf_counter()
    valid, weight, p_next, trainer_served = eagle_weights(args.target, args.draft, sequences, prompt_lengths,
                                                          args.k)
    t_eagle = time.perf_counter() - t0
    t0 = time.perf_counter()
    hist = history_drafts(groups, kept, all_sequences, all_lengths, p_next, args.k, thresholds,
                          args.history_drafts == "sampled")
    t_hist = time.perf_counter() - t0

    k = args.k

    def eagle_source(i):
        return lambda s: (valid[i][:, s], weight[i][:, s], "eagle")

    def history_source(i, c):
        hv, hw = hist[c][i]
        return lambda s: (hv[:, s], hw[:, s], "history")

    def hybrid_source(i, c):
        e, h = eagle_source(i), history_source(i, c)
        return lambda s: h(s) if hist[c][i][0][0, s] else e(s)

    def oracle_source(i, c):
        e, h = eagle_source(i), history_source(i, c)

        def at(s):
            ev, ew, _ = e(s)
            hv, hw, _ = h(s)
            expected = lambda v, w: float(np.cumprod(np.where(v, w, 0.0)).sum())  # noqa: E731
            return h(s) if hv[0] and expected(hv, hw) > expected(ev, ew) else e(s)
        return at

    rows = {"eagle3": pooled([walk(len(sequences[i]), prompt_lengths[i] - 1, k, eagle_source(i))
                              for i in range(len(sequences))])}
    for c in thresholds:
        for name, make in (("history", history_source), ("hybrid", hybrid_source), ("oracle", oracle_source)):
            rows[f"{name}@{c}"] = pooled([walk(len(sequences[i]), prompt_lengths[i] - 1, k, make(i, c))
                                          for i in range(len(sequences))])
    report = {"draft": str(args.draft), "rollouts": str(args.rollouts or args.draft / "warm_start_rollouts.json"),
              "k": k, "group_size": g_size, "kept_epochs": args.kept_epochs,
              "history_drafts": args.history_drafts,
              "held_out_rollouts": len(sequences), "held_out_prompts": len(by_prompt),
              "trainer_served_estimate": trainer_served, "eagle_seconds": round(t_eagle, 1),
              "history_seconds": round(t_hist, 1), "host": host_info(), "policies": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"trainer's served estimate (EAGLE-3): {trainer_served:.3f}")
    for name, r in rows.items():
        print(f"{name:14s} AL {r['acceptance_length']:.3f}  tokens/step {r['tokens_per_step']:.3f}  "
              f"history share {r['history_share_of_drafts']:.2f}  per pos {r['per_position']}")


if __name__ == "__main__":
    main()
