"""A real (small) GRPO loop with speculative rollouts, and the same loop without, same seeds.

Policy: SmolLM2-135M-Instruct (the real fixture). Task: "What is a + b?" with
one-digit numbers, reward 1 when the sum is among the first three integers of
the answer (checked by code). Each step: G samples per prompt from ``vllm serve`` over
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
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        out.append((f"What is {a} + {b}? Answer with just the number.", a + b))
    return out


def reward(text: str, answer: int) -> float:
    """1 when the sum is among the first three integers of the answer.

    SmolLM2-135M restates the question ("2 + 5 is 7") more often than it
    answers with the number alone (measured: the first integer is right in 2%
    of samples, the sum appears in about a fifth), so this rewards getting the
    sum right and saying it early, which GRPO can push up.
    """
    return 1.0 if answer in [int(x) for x in re.findall(r"-?\d+", text)[:3]] else 0.0


class Policy:
    """The trainer side: an HF model, AdamW, GRPO step, logprob recomputation."""

    def __init__(self, model_dir: Path, lr: float, seed: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.version = 0

    def chat(self, prompt: str) -> str:
        if not self.tok.chat_template:  # base models (the tiny test fixture): the task as plain text
            return prompt + "\n"
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

    def grpo_step(self, samples: list[dict], logps: list[torch.Tensor], group: int, clip: float) -> float:
        """GRPO with a clipped importance ratio against vLLM's sampling logprobs.

        The behaviour policy is whatever produced each token (in async mode a
        rollout can span two policy versions), and vLLM reports exactly its
        logprob, so ``exp(logp - vllm_logp)`` corrects both the lag and the
        engine's numerics (bf16) per token.
        """
        rewards = torch.tensor([s["reward"] for s in samples]).view(-1, group)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
        per_seq = []
        for a, lp, s in zip(adv, logps, samples):
            ratio = torch.exp(lp - torch.tensor(s["vllm_logprobs"], dtype=lp.dtype))
            surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
            per_seq.append(surrogate.mean())
        loss = -torch.stack(per_seq).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return float(loss.detach())


def generate(srv, policy: Policy, tasks: list[tuple[str, int]], group: int, max_tokens: int,
             seed: int, step: int) -> tuple[list[dict], float]:
    """G samples per task over the OpenAI API; each carries the policy versions it was sampled under."""
    t0 = time.perf_counter()

    def one(i_task):
        i, (prompt, answer) = i_task
        r = requests.post(srv.url + "/v1/completions", timeout=600, json={
            "model": srv.model, "prompt": policy.chat(prompt), "n": group, "temperature": 1.0,
            "max_tokens": max_tokens, "logprobs": 0, "return_token_ids": True, "seed": seed + i})
        r.raise_for_status()
        body = r.json()
        start = int(r.headers["x-specrl-policy-version-start"])
        end = int(r.headers["x-specrl-policy-version"])
        return [{"rollout_id": f"{step}/{i}/{c['index']}", "prompt_ids": c["prompt_token_ids"],
                 "completion_ids": c["token_ids"], "text": c["text"],
                 "vllm_logprobs": c["logprobs"]["token_logprobs"], "reward": reward(c["text"], answer),
                 "policy_version_start": start, "policy_version_end": end, "group": i}
                for c in sorted(body["choices"], key=lambda c: c["index"])]

    with ThreadPoolExecutor(len(tasks)) as pool:
        samples = [s for group_samples in pool.map(one, enumerate(tasks)) for s in group_samples]
    return samples, time.perf_counter() - t0


def check_rollouts(samples: list[dict], step: int, tasks: int, group: int) -> None:
    """Every (task, sample) of this step exactly once: nothing lost, nothing counted twice."""
    want = {f"{step}/{i}/{j}" for i in range(tasks) for j in range(group)}
    got = [s["rollout_id"] for s in samples]
    if len(got) != len(set(got)) or set(got) != want:
        raise RuntimeError(f"step {step}: rollouts lost or duplicated: {sorted(set(got) ^ want)}")


def run(mode: str, args: argparse.Namespace, target: Path, work: Path) -> dict:
    from vllm_specrl.proposer.checkpoint import init_draft
    from vllm_specrl.server import VLLMServer, free_port
    from vllm_specrl.sync.client import EngineClient

    policy_dir = work / f"policy_{mode}"
    shutil.rmtree(policy_dir, ignore_errors=True)
    shutil.rmtree(work / f"draft-online-{mode}", ignore_errors=True)
    shutil.copytree(target, policy_dir)
    server_args = ["--dtype", args.dtype, "--max-model-len", "1024", "--seed", str(args.seed)]
    trainer = None
    speculative = mode.startswith("spec")
    asynchronous = mode.endswith("-async")
    if speculative:
        draft = Path(args.draft) if args.draft else work / "draft"
        if not args.draft:
            init_draft(target, draft, args.draft_vocab_size, seed=args.seed)
        capture = f"tcp://127.0.0.1:{free_port()}"
        spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": args.k,
                "draft_sample_method": "probabilistic"}
        server_args += ["--speculative-config", json.dumps(spec),
                        "--additional-config", json.dumps({"specrl": {"capture": capture, "capture_topk": 64}})]
    policy = Policy(policy_dir, args.lr, args.seed)
    steps = []
    with VLLMServer(policy_dir, server_args, log_path=work / f"serve_{mode}.log") as srv:
        client = EngineClient(srv.url, progress=False)
        if speculative:
            trainer = subprocess.Popen(
                [sys.executable, "-m", "vllm_specrl.cli", "train-draft", "--capture", capture,
                 "--engine", srv.url, "--draft", str(draft), "--target", str(policy_dir),
                 "--checkpoint-dir", str(work / f"draft-online-{mode}"), "--publish-every", "4",
                 "--checkpoint-every", "50", "--batch-size", "4", "--lr", "1e-3", "--idle-s", "0.5",
                 "--replay-ratio", str(args.draft_replay_ratio), "--log", str(work / f"online_draft_{mode}.jsonl")],
                stdout=open(work / f"draft_trainer_{mode}.out", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"),
                # The draft trainer shares these 2 cores with the engine and this loop (on a GPU
                # cluster it has its own device): it takes cycles they leave, and a bounded number.
                preexec_fn=lambda: os.nice(args.draft_nice))
        pool = ThreadPoolExecutor(1)

        def rollouts(step: int):
            return generate(srv, policy, make_tasks(step, args.prompts, args.seed), args.group,
                            args.max_tokens, args.seed * 7919 + step * 101, step)

        try:
            # Async (policy lag 1): rollouts of step t+1 run while step t trains; the update lands in
            # flight (pause "keep": running requests continue on the new weights, KV recomputed), so a
            # rollout can span two versions, which its headers record and the clipped ratio corrects.
            pending = pool.submit(rollouts, 0) if asynchronous else None
            # Acceptance per step from the engine's counters between consecutive snapshots taken
            # after each step's rollouts arrive (in async mode they ran during the previous step).
            before = client.status()
            for step in range(args.steps):
                t_step = time.perf_counter()
                t0 = time.perf_counter()
                if asynchronous:
                    samples, t_gen = pending.result()
                    pending = pool.submit(rollouts, step + 1) if step + 1 < args.steps else None
                else:
                    samples, t_gen = rollouts(step)
                t_exposed = time.perf_counter() - t0
                after = client.status()
                check_rollouts(samples, step, args.prompts, args.group)
                t0 = time.perf_counter()
                logps = policy.token_logprobs(samples)
                t_logp = time.perf_counter() - t0
                abs_diffs = [(lp.detach() - torch.tensor(s["vllm_logprobs"])).abs() for lp, s in zip(logps, samples)]
                diffs = torch.cat(abs_diffs)
                on_policy = [s["policy_version_start"] == s["policy_version_end"] == policy.version for s in samples]
                t0 = time.perf_counter()
                loss = policy.grpo_step(samples, logps, args.group, args.clip)
                t_train = time.perf_counter() - t0
                t0 = time.perf_counter()
                client.update_policy(policy.model.named_parameters(), version=step + 1,
                                     pause="keep" if asynchronous else "wait")
                policy.version = step + 1
                # Nothing to write for the draft trainer: capture_topk sends it the policy's own
                # next-token distributions with every captured row.
                t_sync = time.perf_counter() - t0
                sd0, sd1 = before["spec_decode"], after["spec_decode"]
                drafts = sd1["num_drafts"] - sd0["num_drafts"]
                versions = sorted({(s["policy_version_start"], s["policy_version_end"]) for s in samples})
                rec = {"step": step, "mean_reward": sum(s["reward"] for s in samples) / len(samples),
                       "rewards": [s["reward"] for s in samples], "loss": loss,
                       "generation_s": t_gen, "exposed_generation_s": t_exposed, "logprob_s": t_logp,
                       "training_s": t_train, "sync_s": t_sync, "step_s": time.perf_counter() - t_step,
                       "rollouts": len(samples), "tokens": sum(len(s["completion_ids"]) for s in samples),
                       "acceptance_length": (1 + (sd1["num_accepted_tokens"] - sd0["num_accepted_tokens"]) / drafts)
                       if drafts else None,
                       "policy_version": after["versions"]["policy"], "draft_version": after["versions"]["draft"],
                       "rollout_policy_versions": [list(v) for v in versions],
                       "rollouts_from_trained_version": sum(on_policy),
                       "logprob_abs_diff_max": float(diffs.max()), "logprob_abs_diff_mean": float(diffs.mean())}
                # Same sequences, recomputed by the trainer: only on-policy rollouts can match vLLM exactly.
                same = [d for d, on in zip(abs_diffs, on_policy) if on]
                rec["on_policy_logprob_abs_diff_max"] = float(torch.cat(same).max()) if same else None
                steps.append(rec)
                before = after
                print(f"[rl:{mode}] step {step}: reward {rec['mean_reward']:.2f}, gen {t_gen:.1f}s "
                      f"(exposed {t_exposed:.1f}s), logp {t_logp:.1f}s, train {t_train:.1f}s, sync {t_sync:.1f}s, "
                      f"step {rec['step_s']:.1f}s, accept {rec['acceptance_length'] or float('nan'):.2f}, "
                      f"versions {versions}, "
                      f"|dlogp| max {rec['logprob_abs_diff_max']:.3f}", flush=True)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # a queued next-step rollout is dropped
            if trainer is not None:
                trainer.send_signal(signal.SIGINT)
                trainer.wait(60)
    return {"mode": mode, "steps": steps}


STAGES = ("exposed_generation_s", "logprob_s", "training_s", "sync_s")


def summarize(runs: dict) -> dict:
    """Mean stage times per run, ratios against the matching plain run, reward agreement."""
    summary: dict = {}
    for mode, r in runs.items():
        steps = r["steps"]
        mean = lambda k: sum(s[k] for s in steps) / len(steps)  # noqa: E731
        rewards = [x for s in steps for x in s["rewards"]]
        p = sum(rewards) / len(rewards)
        accepted = [s["acceptance_length"] for s in steps if s["acceptance_length"]]
        on_policy = [s["on_policy_logprob_abs_diff_max"] for s in steps
                     if s["on_policy_logprob_abs_diff_max"] is not None]
        summary[mode] = {**{k: mean(k) for k in ("generation_s", *STAGES, "step_s")},
                         "mean_reward": p, "reward_se": (p * (1 - p) / len(rewards)) ** 0.5,
                         "rollouts": sum(s["rollouts"] for s in steps),
                         "acceptance_length_first": accepted[0] if accepted else None,
                         "acceptance_length_last": accepted[-1] if accepted else None,
                         "logprob_abs_diff_max": max(s["logprob_abs_diff_max"] for s in steps),
                         "logprob_abs_diff_mean": sum(s["logprob_abs_diff_mean"] * s["tokens"] for s in steps)
                         / max(1, sum(s["tokens"] for s in steps)),
                         "on_policy_logprob_abs_diff_max": max(on_policy) if on_policy else None}
    comparisons = {}
    for mode in runs:
        # Against the same schedule without speculation, else against plain sync (async + spec stacked).
        base = mode.replace("spec", "plain") if mode.replace("spec", "plain") in runs else "plain"
        if mode.startswith("spec") and base in runs:
            a, b = summary[mode], summary[base]
            se = (a["reward_se"] ** 2 + b["reward_se"] ** 2) ** 0.5
            z = (a["mean_reward"] - b["mean_reward"]) / se if se > 0 else 0.0
            comparisons[f"{mode}_vs_{base}"] = {
                "step_time": a["step_s"] / b["step_s"], "rollout_time": a["generation_s"] / b["generation_s"],
                "reward_difference": a["mean_reward"] - b["mean_reward"], "reward_z": z,
                "rewards_agree_within_noise": abs(z) < 3}
    for mode in runs:
        if mode.endswith("-async") and mode.removesuffix("-async") in runs:
            comparisons[f"{mode}_vs_{mode.removesuffix('-async')}"] = {
                "step_time": summary[mode]["step_s"] / summary[mode.removesuffix("-async")]["step_s"]}
    summary["comparisons"] = comparisons
    return summary


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for mode, run_ in runs.items():
        xs = [s["step"] for s in run_["steps"]]
        axes[0].plot(xs, [s["mean_reward"] for s in run_["steps"]], marker="o", label=mode)
        if mode.startswith("spec"):
            axes[1].plot(xs, [s["acceptance_length"] or float("nan") for s in run_["steps"]], marker="o", label=mode)
    axes[0].set_title("mean reward per step")
    axes[1].set_title("acceptance length (draft trained online)")
    modes = list(runs)
    bottoms = [0.0] * len(modes)
    for stage in STAGES:
        vals = [report["summary"][m][stage] for m in modes]
        axes[2].bar(modes, vals, bottom=bottoms, label=stage.removesuffix("_s"))
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    axes[2].scatter(modes, [report["summary"][m]["step_s"] for m in modes], color="k", marker="_", s=400,
                    label="wall step time", zorder=3)
    axes[2].set_title("mean step time (s): exposed generation + training side")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend()
    axes[1].legend()
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(report: dict) -> None:
    summary = report["summary"]
    print("\nrun          gen_s exposed  logp_s train_s  sync_s  step_s  reward  accept(first->last)  "
          "|dlogp| mean/max  on-policy max")
    for mode in report["runs"]:
        s = summary[mode]
        acc = (f"{s['acceptance_length_first']:.2f}->{s['acceptance_length_last']:.2f}"
               if s["acceptance_length_first"] else "-")
        onp = f"{s['on_policy_logprob_abs_diff_max']:.3f}" if s["on_policy_logprob_abs_diff_max"] is not None else "-"
        print(f"{mode:11s} {s['generation_s']:6.1f} {s['exposed_generation_s']:7.1f} {s['logprob_s']:7.1f} "
              f"{s['training_s']:7.1f} {s['sync_s']:7.1f} {s['step_s']:7.1f} {s['mean_reward']:7.2f}  "
              f"{acc:>19s}  {s['logprob_abs_diff_mean']:.4f}/{s['logprob_abs_diff_max']:.3f} {onp:>14s}")
    for name, c in summary["comparisons"].items():
        extra = (f", rollout time {c['rollout_time']:.2f}, reward diff {c['reward_difference']:+.3f} "
                 f"(z {c['reward_z']:+.2f}, {'agree' if c['rewards_agree_within_noise'] else 'DISAGREE'})"
                 if "rollout_time" in c else "")
        print(f"{name}: step time {c['step_time']:.2f}{extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=None)
    ap.add_argument("--target", type=Path, default=None, help="policy checkpoint (default: the real fixture)")
    ap.add_argument("--runs", default="spec,plain,spec-async",
                    help="comma list of spec, plain, spec-async, plain-async (async = policy lag 1)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--clip", type=float, default=0.2, help="PPO clip of the importance ratio")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--draft", default=None, help="EAGLE-3 draft to start from (default: fresh)")
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--draft-replay-ratio", type=float, default=4.0,
                    help="online draft trainer: samples trained per captured rollout")
    ap.add_argument("--draft-nice", type=int, default=5, help="niceness of the online draft trainer process")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/rl_demo.json"))
    args = ap.parse_args()

    from vllm_specrl.fixtures import fixture_target

    target = args.target or Path(fixture_target("real", args.fixtures))
    work = args.out.parent / (args.out.stem + "_work")
    work.mkdir(parents=True, exist_ok=True)
    report = {"demo": "grpo_speculative_rollouts", "settings": {k: str(v) for k, v in vars(args).items()},
              "runs": {}}
    for mode in args.runs.split(","):
        report["runs"][mode] = run(mode, args, target, work)
        args.out.write_text(json.dumps(report, indent=2))
    report["summary"] = summarize(report["runs"])
    png = args.out.with_suffix(".png")
    plot(report, png)
    report["plot"] = str(png)
    args.out.write_text(json.dumps(report, indent=2))
    print_table(report)
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
