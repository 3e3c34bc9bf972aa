"""GRPO on your own task with speculative rollouts, written with ``vllm_specrl.rl``.

Your parts: the task (prompts and what a reward compares with) and the reward. The package's: the
engine's serve arguments (``serve_args``: an EAGLE-3 draft, capture for the online draft trainer,
adaptive k), the engine itself (``VLLMServer`` runs ``vllm serve``; in production you start it
yourself with ``ServeArgs.command``), the online draft trainer (``DraftTrainerProcess``), and each
step in order (``GRPOLoop.step``: rollouts with policy versions, the GRPO update, the weights
published in place as the next policy version).

    python examples/grpo_loop.py --policy /ckpt/policy --draft /ckpt/draft --steps 10
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from vllm_specrl import EngineClient
from vllm_specrl.rl.draft_trainer import DraftTrainerProcess, DraftTrainerSettings, trainer_cpus
from vllm_specrl.rl.loop import GRPOLoop
from vllm_specrl.rl.policy import Policy
from vllm_specrl.rl.serving import serve_args
from vllm_specrl.launcher import VLLMServer, free_port

WORDS = ["apple", "river", "stone", "cloud", "ember", "maple", "quartz", "harbor"]


def tasks(step: int, n: int = 4) -> list[tuple[str, str]]:
    """Your task: repeat a word three times (the answer the reward checks)."""
    rng = random.Random(step)
    return [(f"Repeat the word {w} three times:", w) for w in rng.sample(WORDS, n)]


def reward(text: str, word: str) -> float:
    """The word's repetitions (up to three), plus a shaping term for an answer of the right length, so
    that early answers, all wrong, still differ (GRPO learns nothing from a group with equal rewards)."""
    target = " ".join([word] * 3)
    shaping = max(0.0, 1 - abs(len(text.strip()) - len(target)) / len(target))
    return min(text.lower().count(word), 3) / 3 + 0.1 * shaping


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", type=Path, required=True, help="the policy checkpoint (HF directory)")
    ap.add_argument("--draft", type=Path, required=True, help="its EAGLE-3 draft (vllm-specrl init-draft makes one)")
    ap.add_argument("--work-dir", type=Path, default=Path("grpo_work"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    serving = serve_args("eagle3", k=3, draft=args.draft, capture=f"tcp://127.0.0.1:{free_port()}",
                         dtype=args.dtype, max_model_len=1024)
    print("serving with:", " ".join(serving.command(args.policy)), flush=True)
    policy = Policy(args.policy, lr=args.lr, seed=0)
    with VLLMServer(args.policy, serving.args, log_path=args.work_dir / "serve.log") as server:
        engine = EngineClient(server.url, progress=False)
        trainer = DraftTrainerProcess.start(serving.capture, server.url, args.draft, args.policy, args.work_dir,
                                            DraftTrainerSettings(), cpus=trainer_cpus("auto", engine.status()))
        try:
            with GRPOLoop(engine, server.model, policy, tasks, reward, steps=args.steps, group=args.group,
                          max_tokens=args.max_tokens, draft_trainer=trainer) as loop:
                for i in range(args.steps):
                    step = loop.step(i)
                    diffs = step.logprob_abs_diff()
                    print(json.dumps({
                        "step": i, "mean_reward": sum(s["reward"] for s in step.samples) / len(step.samples),
                        "sampled_by": sorted({s["policy_version_end"] for s in step.samples}),
                        "policy_version": policy.version, "acceptance_length": step.served["acceptance_length"],
                        "drafts": step.served["num_drafts"],
                        # the trainer's logprobs against vLLM's, where the same weights sampled and scored
                        "on_policy_logprob_abs_diff_max": max((float(d.max()) for d, on in zip(diffs, step.on_policy)
                                                               if on), default=None),
                        "step_s": round(step.step_s, 2)}), flush=True)
        finally:
            trainer.stop()  # the last published draft keeps serving
        print(json.dumps({"final_status": {k: engine.status()[k] for k in ("versions", "spec_decode")}}), flush=True)


if __name__ == "__main__":
    main()
