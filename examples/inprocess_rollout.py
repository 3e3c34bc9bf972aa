"""An in-process ``AsyncLLM`` rollout worker beside a trainer, the shape verl and OpenRLHF use, with the
package's guarantees and no HTTP anywhere.

- The engine takes the framework's worker extension combined with the package's (``combined_extension``).
- Capture starts with the engine, from its configuration (``"capture": ADDRESS``).
- Rollouts come back stamped with the policy version they were sampled under (``SpecRLEngine.generate``).
- The policy trainer's update commits in place while a rollout is in flight (``await commit_update``):
  validated on every rank, all or none, the in-flight request resumed on the new weights; a malformed
  update is refused and the old weights keep serving.
- The online draft trainer runs in a thread of this process and publishes its drafts into the engine
  (``start_online_trainer``).

    python examples/inprocess_rollout.py --policy /ckpt/policy --draft /ckpt/draft --out report.json

It prints (and writes) a JSON report of what each step did. The tests run it on the tiny fixture.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CHECKED = ["model.norm.weight"]   # parameters the framework's extension reads back


def moved(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Stands for one policy-training step: every weight nudged."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * v.std().nan_to_num() * torch.randn(v.shape, generator=g).to(v.dtype) if v.is_floating_point()
            else v for k, v in state.items()}


async def collect(engine, prompts: list[str], params, started: asyncio.Event | None = None) -> list:
    async def one(prompt: str):
        final = None
        async for out in engine.generate(prompt, params, request_id=uuid.uuid4().hex):
            final = out
            if started is not None:
                started.set()  # the first tokens are out: the request is running
        return final
    return list(await asyncio.gather(*(one(p) for p in prompts)))


def summary(outputs: list) -> list[dict]:
    return [{"text": o.outputs[0].text, "tokens": list(o.outputs[0].token_ids),
             "policy_version_start": o.policy_version_start, "policy_version": o.policy_version} for o in outputs]


async def run(args: argparse.Namespace) -> dict:
    from safetensors.torch import load_file
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_specrl.inprocess.engine import SpecRLEngine
    from vllm_specrl.inprocess.extension import combined_extension
    from vllm_specrl.inprocess.trainer_client import start_online_trainer
    from vllm_specrl.launcher import free_port
    from vllm_specrl.trainer.online import OnlineConfig

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(HERE))
    capture = f"tcp://127.0.0.1:{free_port()}"
    engine = SpecRLEngine(AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=args.policy, dtype="float32", enforce_eager=True, max_model_len=512, seed=0, max_num_seqs=8,
        disable_log_stats=False, speculative_config={"method": "eagle3", "model": args.draft,
                                                     "num_speculative_tokens": 3},
        worker_extension_cls=combined_extension("framework_extension.FrameworkExtension"),
        additional_config={"specrl": {"capture": capture, "capture_sender": "thread"}})))
    report: dict = {"capture": capture}
    trainer = start_online_trainer(engine, asyncio.get_running_loop(), args.draft, args.policy,
                                   OnlineConfig(capture=capture, batch_size=2, publish_every=2, holdout_every=0,
                                                idle_s=0.1), checkpoint_dir=Path(args.work) / "online-draft")
    try:
        greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        prompts = [f"def function_{i}(x):" for i in range(args.prompts)]
        report["before"] = summary(await collect(engine, prompts, greedy))
        original = load_file(str(Path(args.policy) / "model.safetensors"))
        bad = dict(original, **{CHECKED[0]: original[CHECKED[0]][:-1]})   # a malformed update
        report["refused"] = await engine.commit_update("policy", bad, 1)
        report["after_refusal"] = summary(await collect(engine, prompts, greedy))
        new = moved(original, seed=1)
        # A rollout in flight while the update commits: it finishes on the new weights, stamped 0 -> 1. The commit
        # starts once its first tokens are out; it is long enough (most of max_model_len) to be running still
        # when the commit pauses generation.
        long = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
        started = asyncio.Event()
        in_flight = asyncio.ensure_future(collect(engine, prompts[:1], long, started))
        await started.wait()
        report["committed"] = await engine.commit_update("policy", new, 1)
        report["in_flight"] = summary(await in_flight)
        report["after_commit"] = summary(await collect(engine, prompts, greedy))
        report["pushed_sums"] = {k: float(new[k].double().sum()) for k in CHECKED}
        report["served_sums"] = (await engine.engine.collective_rpc("framework_param_sums", args=(CHECKED,)))[0]
        sampled = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=0)
        for _ in range(args.draft_rounds):   # rollouts for the draft trainer to learn from
            await collect(engine, prompts * 2, sampled)
            await asyncio.sleep(1.0)
        report["status"] = {k: v for k, v in (await engine.status()).items()
                            if k in ("versions", "capture", "draft_trainer", "spec_decode")}
    finally:
        report["trainer"] = await asyncio.to_thread(trainer.stop)
        engine.engine.shutdown()
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--work", default="inprocess-work")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--draft-rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    report = asyncio.run(run(args))
    text = json.dumps(report, indent=1, default=str)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
