"""A real (small) GRPO loop with speculative rollouts, and the same loop without, same seeds.

Policy: SmolLM2-135M-Instruct (the real fixture). Task: "What is a + b?" with
small numbers, reward 1 when the first integer in the answer is right
(checked by code). Each step: G samples per prompt from ``vllm serve`` over
the OpenAI completions API with logprobs and token ids; the trainer
recomputes the sampled tokens' logprobs with the torch policy (and compares
them with vLLM's: lossless in the RL sense), takes one GRPO policy-gradient
step, and pushes the new weights into the engine in place
(``EngineClient.update_policy``). In the speculative run an EAGLE-3 draft
serves the rollouts, capture streams the policy's hidden states, and the
online draft trainer (``vllm-specrl train-draft --capture``) keeps the draft
following the policy. Per step it records generation, logprob
recomputation, training and sync times, acceptance length, versions and mean
reward; at the end it prints a table and writes JSON and a PNG.

    python scripts/rl_demo.py --fixtures .fixtures            # both runs, defaults
    python scripts/rl_demo.py --runs spec --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch


def make_tasks(step: int, n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed * 1000 + step)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        out.append((f"What is {a} + {b}? Answer with just the number.", a + b))
    return out


def reward(text: str, answer: int) -> float:
    match = re.search(r"-?\d+", text)
    return 1.0 if match and int(match.group()) == answer else 0.0


class Policy:
    """The trainer side: an HF model, AdamW, GRPO step, logprob recomputation."""

    def __init__(self, model_dir: Path, lr: float, seed: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)

    def chat(self, prompt: str) -> str:
        return self.tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                            add_generation_prompt=True)

    def token_logprobs(self, samples: list[dict]) -> list[torch.Tensor]:
        """Per-sample logprobs of the completion tokens under the current policy (with grad)."""
        seqs = [s["prompt_ids"] + s["completion_ids"] for s in samples]
        width = max(len(x) for x in seqs)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, : len(x)] = torch.tensor(x)
            mask[i, : len(x)] = 1
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        out = []
        for i, s in enumerate(samples):
            start = len(s["prompt_ids"]) - 1
            out.append(logp[i, start : start + len(s["completion_ids"])])
        return out

    def grpo_step(self, samples: list[dict], logps: list[torch.Tensor], group: int) -> float:
        rewards = torch.tensor([s["reward"] for s in samples]).view(-1, group)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
        loss = -torch.stack([a * lp.mean() for a, lp in zip(adv, logps)]).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return float(loss)

    def save(self, model_dir: Path) -> None:
        """Write the policy where the online draft trainer reads the target's LM head."""
        from safetensors.torch import save_file

        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.model.state_dict().items()
                 if k != "lm_head.weight" or not self.model.config.tie_word_embeddings}
        tmp = model_dir / "model.safetensors.tmp"
        save_file(state, tmp, metadata={"format": "pt"})
        tmp.replace(model_dir / "model.safetensors")


def generate(srv, policy: Policy, tasks: list[tuple[str, int]], group: int, max_tokens: int,
             seed: int) -> list[dict]:
    def one(i_task):
        i, (prompt, answer) = i_task
        r = requests.post(srv.url + "/v1/completions", timeout=600, json={
            "model": srv.model, "prompt": policy.chat(prompt), "n": group, "temperature": 1.0,
            "max_tokens": max_tokens, "logprobs": 0, "return_token_ids": True, "seed": seed + i})
        r.raise_for_status()
        body = r.json()
        version = r.headers.get("x-specrl-policy-version")
        return [{"prompt_ids": body["choices"][0]["prompt_token_ids"] if "prompt_token_ids" in body["choices"][0]
                 else body.get("prompt_token_ids"),
                 "completion_ids": c["token_ids"], "text": c["text"],
                 "vllm_logprobs": c["logprobs"]["token_logprobs"], "reward": reward(c["text"], answer),
                 "policy_version": version, "group": i}
                for c in sorted(body["choices"], key=lambda c: c["index"])]

    with ThreadPoolExecutor(len(tasks)) as pool:
        return [s for group_samples in pool.map(one, enumerate(tasks)) for s in group_samples]


def run(mode: str, args: argparse.Namespace, target: Path, work: Path) -> dict:
    from vllm_specrl.proposer.checkpoint import init_draft
    from vllm_specrl.server import VLLMServer, free_port
    from vllm_specrl.sync.client import EngineClient

    policy_dir = work / f"policy_{mode}"
    shutil.rmtree(policy_dir, ignore_errors=True)
    shutil.copytree(target, policy_dir)
    server_args = ["--dtype", args.dtype, "--max-model-len", "1024", "--seed", str(args.seed)]
    trainer = None
    if mode == "spec":
        draft = Path(args.draft) if args.draft else work / "draft"
        if not args.draft:
            init_draft(target, draft, args.draft_vocab_size, seed=args.seed)
        capture = f"tcp://127.0.0.1:{free_port()}"
        spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": args.k,
                "draft_sample_method": "probabilistic"}
        server_args += ["--speculative-config", json.dumps(spec),
                        "--additional-config", json.dumps({"specrl": {"capture": capture}})]
    policy = Policy(policy_dir, args.lr, args.seed)
    steps = []
    with VLLMServer(policy_dir, server_args, log_path=work / f"serve_{mode}.log") as srv:
        client = EngineClient(srv.url, progress=False)
        if mode == "spec":
            trainer = subprocess.Popen(
                [sys.executable, "-m", "vllm_specrl.cli", "train-draft", "--capture", capture,
                 "--engine", srv.url, "--draft", str(draft), "--target", str(policy_dir),
                 "--checkpoint-dir", str(work / "draft-online"), "--publish-every", "4",
                 "--checkpoint-every", "50", "--batch-size", "4", "--lr", "1e-3", "--idle-s", "0.5",
                 "--log", str(work / "online_draft.jsonl")],
                stdout=open(work / "draft_trainer.out", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
        try:
            for step in range(args.steps):
                tasks = make_tasks(step, args.prompts, args.seed)
                before = client.status()
                t0 = time.perf_counter()
                samples = generate(srv, policy, tasks, args.group, args.max_tokens, args.seed * 7919 + step * 101)
                t_gen = time.perf_counter() - t0
                after = client.status()
                t0 = time.perf_counter()
                logps = policy.token_logprobs(samples)
                t_logp = time.perf_counter() - t0
                diffs = torch.cat([(lp.detach() - torch.tensor(s["vllm_logprobs"])).abs()
                                   for lp, s in zip(logps, samples)])
                t0 = time.perf_counter()
                loss = policy.grpo_step(samples, logps, args.group)
                t_train = time.perf_counter() - t0
                t0 = time.perf_counter()
                client.update_policy(policy.model.named_parameters(), version=step + 1)
                if mode == "spec":
                    policy.save(policy_dir)
                t_sync = time.perf_counter() - t0
                sd0, sd1 = before["spec_decode"], after["spec_decode"]
                drafts = sd1["num_drafts"] - sd0["num_drafts"]
                rec = {"step": step, "mean_reward": sum(s["reward"] for s in samples) / len(samples),
                       "loss": loss, "generation_s": t_gen, "logprob_s": t_logp, "training_s": t_train,
                       "sync_s": t_sync, "tokens": sum(len(s["completion_ids"]) for s in samples),
                       "acceptance_length": (1 + (sd1["num_accepted_tokens"] - sd0["num_accepted_tokens"]) / drafts)
                       if drafts else None,
                       "policy_version": after["versions"]["policy"], "draft_version": after["versions"]["draft"],
                       "rollout_policy_versions": sorted({s["policy_version"] for s in samples}),
                       "logprob_abs_diff_max": float(diffs.max()), "logprob_abs_diff_mean": float(diffs.mean())}
                steps.append(rec)
                print(f"[rl:{mode}] step {step}: reward {rec['mean_reward']:.2f}, gen {t_gen:.1f}s, "
                      f"logp {t_logp:.1f}s, train {t_train:.1f}s, sync {t_sync:.1f}s, accept "
                      f"{rec['acceptance_length'] or 0:.2f}, |dlogp| max {rec['logprob_abs_diff_max']:.3f}",
                      flush=True)
        finally:
            if trainer is not None:
                trainer.send_signal(signal.SIGINT)
                trainer.wait(60)
    return {"mode": mode, "steps": steps}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for mode, run_ in runs.items():
        xs = [s["step"] for s in run_["steps"]]
        axes[0].plot(xs, [s["mean_reward"] for s in run_["steps"]], marker="o", label=mode)
        if mode == "spec":
            axes[1].plot(xs, [s["acceptance_length"] or float("nan") for s in run_["steps"]], marker="o")
    axes[0].set_title("mean reward")
    axes[1].set_title("acceptance length (spec run)")
    stages = ["generation_s", "logprob_s", "training_s", "sync_s"]
    bottoms = {m: 0.0 for m in runs}
    for stage in stages:
        vals = [sum(s[stage] for s in runs[m]["steps"]) / len(runs[m]["steps"]) for m in runs]
        axes[2].bar(list(runs), vals, bottom=[bottoms[m] for m in runs], label=stage)
        for m, v in zip(runs, vals):
            bottoms[m] += v
    axes[2].set_title("mean step time breakdown (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend()
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=None)
    ap.add_argument("--runs", default="spec,plain")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--draft", default=None, help="EAGLE-3 draft to start from (default: fresh)")
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/rl_demo.json"))
    args = ap.parse_args()

    from vllm_specrl.fixtures import fixture_target

    target = Path(fixture_target("real", args.fixtures))
    work = args.out.parent / "rl_work"
    work.mkdir(parents=True, exist_ok=True)
    report = {"demo": "grpo_speculative_rollouts", "settings": {k: str(v) for k, v in vars(args).items()},
              "runs": {}}
    for mode in args.runs.split(","):
        report["runs"][mode] = run(mode, args, target, work)
        args.out.write_text(json.dumps(report, indent=2))
    summary = {}
    for mode, r in report["runs"].items():
        n = len(r["steps"])
        mean = lambda k: sum(s[k] for s in r["steps"]) / n  # noqa: E731
        summary[mode] = {k: mean(k) for k in ("generation_s", "logprob_s", "training_s", "sync_s", "mean_reward")}
        summary[mode]["step_s"] = sum(summary[mode][k] for k in ("generation_s", "logprob_s", "training_s", "sync_s"))
        summary[mode]["logprob_abs_diff_max"] = max(s["logprob_abs_diff_max"] for s in r["steps"])
    if "spec" in summary and "plain" in summary:
        summary["ratios_spec_vs_plain"] = {
            "step_time": summary["spec"]["step_s"] / summary["plain"]["step_s"],
            "rollout_time": summary["spec"]["generation_s"] / summary["plain"]["generation_s"]}
    report["summary"] = summary
    png = args.out.with_suffix(".png")
    plot(report, png)
    report["plot"] = str(png)
    args.out.write_text(json.dumps(report, indent=2))
    print("\nmode    gen_s  logp_s  train_s  sync_s  step_s  reward  max|dlogp|")
    for mode in report["runs"]:
        s = summary[mode]
        print(f"{mode:6s} {s['generation_s']:6.1f} {s['logprob_s']:7.1f} {s['training_s']:8.1f} "
              f"{s['sync_s']:7.1f} {s['step_s']:7.1f} {s['mean_reward']:7.2f} {s['logprob_abs_diff_max']:10.3f}")
    if "ratios_spec_vs_plain" in summary:
        r = summary["ratios_spec_vs_plain"]
        print(f"spec/plain: step time {r['step_time']:.2f}, rollout time {r['rollout_time']:.2f}")
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
