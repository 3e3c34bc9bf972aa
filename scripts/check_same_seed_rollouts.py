"""How much of a rollout comes back when the next epoch samples the same prompt with the same noise.

The question behind a tempting history proposer (issue 13): sample every (prompt, sample index)
with the same per-position noise every epoch (Gumbel-max, noise keyed by seed and position), and a
policy that moved a little reproduces most of its last rollout, which a history proposer could then
draft and a sample-and-compare verifier accept. This measures that agreement on SmolLM2 (HF, float32,
the demo's ``explain`` prompts): rollouts under the policy, then under the policy after a few Adam
steps of a GRPO-like loss at the RL demo's learning rate, same noise, and the acceptance length a
k-token replay of the old rollout would get. (The answer, and why the project does not ship it, is in
benchmarks/README.md: the agreement is high exactly because the new sample reuses noise the update
was trained on, so it is not a fresh sample of the updated policy.)

    python scripts/check_same_seed_rollouts.py --out results/same_seed_rollouts.json
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from vllm_specrl.bench_engine import host_info


def gumbel(seed: int, position: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100_003 + position)
    return -torch.log(torch.empty(vocab).exponential_(generator=g))


@torch.no_grad()
def rollout(model, prompt: list[int], seed: int, max_tokens: int, eos: int) -> list[int]:
    """Gumbel-max sampling at T = 1 with noise keyed by (seed, position): the same seed, the same noise."""
    out, past, x = [], None, torch.tensor([prompt])
    for position in range(max_tokens):
        o = model(x, past_key_values=past, use_cache=True)
        past = o.past_key_values
        logp = torch.log_softmax(o.logits[0, -1].float(), -1)
        token = int(torch.argmax(logp + gumbel(seed, position, logp.numel())))
        out.append(token)
        if token == eos:
            break
        x = torch.tensor([[token]])
    return out


def moved(model, prompts: list[list[int]], steps: int, lr: float, eos: int):
    """``steps`` Adam steps of a GRPO-like loss (own 24-token samples, advantages +-1)."""
    policy = copy.deepcopy(model).train()
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    for step in range(steps):
        opt.zero_grad()
        loss = 0.0
        for i, prompt in enumerate(prompts):
            completion = rollout(model, prompt, 10_000 + 97 * step + i, 24, eos)
            ids = torch.tensor([prompt + completion])
            logp = torch.log_softmax(policy(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])
            loss = loss - (1.0 if (step + i) % 2 else -1.0) * logp[len(prompt) - 1:].sum()
        loss.backward()
        opt.step()
    return policy.eval()


def replay_acceptance_length(old: list[int], new: list[int], k: int) -> float:
    """Tokens per verify step if each step drafts the old rollout's next k tokens at the same positions
    and a sample-and-compare verifier keeps them while they equal the new rollout's."""
    position, steps = 0, 0
    while position < len(new):
        accepted = 0
        while (accepted < k and position + accepted < min(len(old), len(new) - 1)
               and old[position + accepted] == new[position + accepted]):
            accepted += 1
        position += accepted + 1
        steps += 1
    return len(new) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=Path(".fixtures"))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-6, help="the RL demo's default")
    ap.add_argument("--steps", default="1,4", help="policy updates between the two epochs")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("results/same_seed_rollouts.json"))
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_specrl.rl.tasks import make_tasks

    torch.manual_seed(0)
    path = args.fixtures / "real" / "target"
    tok = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tasks = make_tasks(0, args.prompts, 0, "explain", dataset_size=args.prompts)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False)).input_ids for p, _ in tasks]
    old = [rollout(base, p, 1 + i, args.max_tokens, tok.eos_token_id) for i, p in enumerate(prompts)]
    results = []
    for steps in (int(s) for s in args.steps.split(",")):
        policy = moved(base, prompts[:4], steps, args.lr, tok.eos_token_id)
        new = [rollout(policy, p, 1 + i, args.max_tokens, tok.eos_token_id) for i, p in enumerate(prompts)]
        per_prompt = []
        for o, n in zip(old, new, strict=True):
            common = min(len(o), len(n))
            per_prompt.append({"old_len": len(o), "new_len": len(n),
                               "first_divergence": next((j for j in range(common) if o[j] != n[j]), common),
                               "same_position": sum(o[j] == n[j] for j in range(common)),
                               "replay_acceptance_length": round(replay_acceptance_length(o, n, args.k), 3)})
        mean_al = sum(p["replay_acceptance_length"] for p in per_prompt) / len(per_prompt)
        print(f"{steps} update(s) at lr {args.lr}: replay AL (k={args.k}) {mean_al:.2f}; "
              f"first divergence {[p['first_divergence'] for p in per_prompt]}", flush=True)
        results.append({"updates": steps, "mean_replay_acceptance_length": round(mean_al, 3), "prompts": per_prompt})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"check": "same_seed_rollouts", "host": host_info(), "lr": args.lr,
                                    "k": args.k, "max_tokens": args.max_tokens, "results": results}, indent=2))


if __name__ == "__main__":
    main()
