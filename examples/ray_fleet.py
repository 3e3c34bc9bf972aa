"""A trainer and two speculative engine replicas as Ray actors, the policy broadcast once per step.

The layout RL frameworks use: engine replicas and a trainer placed as Ray actors. Each replica is a
whole vLLM engine with the plugin (an EAGLE-3 draft, capture, ``specrl_gloo`` weight transfer) inside
one actor (``vllm_specrl.integrations.ray_actors``); the trainer actor takes a policy-gradient step on
both replicas' rollouts and broadcasts the new weights to every replica with one gloo broadcast
(``EngineGroup``: all replicas or none), then a draft the same way, while it counts the captured frames
by policy version. At the end a fresh engine, plain, serves the trainer's last weights: every replica's
greedy tokens must equal its (lossless, and the broadcast arrived).

    python examples/ray_fleet.py --policy /ckpt/policy --draft /ckpt/draft --steps 2
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
from pathlib import Path

import ray

from vllm_specrl.integrations.ray_actors import EngineActor, RayEngineClient

EngineReplica = ray.remote(EngineActor)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@ray.remote
class Trainer:
    """The policy, its optimizer, the capture receiver and the gloo sender to every replica."""

    def __init__(self, policy: str, draft: str, replicas: list, capture: str, lr: float):
        import torch
        from transformers import AutoModelForCausalLM

        from vllm_specrl.capture.receiver import CaptureReceiver
        from vllm_specrl.sync.clients.engine_group import EngineGroup

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.draft = draft
        self.group = EngineGroup([RayEngineClient(r) for r in replicas])
        self.receiver = CaptureReceiver(capture)
        self.frames: dict[str, int] = {}

    def _sender(self, source):
        from vllm_specrl.sync.backends.gloo_backend import GlooTrainerInitInfo, SpecRLGlooTrainerWeightTransferEngine

        return SpecRLGlooTrainerWeightTransferEngine.trainer_init(
            GlooTrainerInitInfo("127.0.0.1", free_port(), self.group.world_size, rank=0, timeout_s=300),
            client=self.group, source=source)

    def step(self, prompts: list[list[int]], samples: list[list[list[int]]], version: int) -> float:
        """One policy-gradient step (reward: distinct tokens, group-normalised), then the broadcast."""
        import torch
        from vllm.distributed.weight_transfer.base import ModuleSource

        self.opt.zero_grad()
        loss_total = 0.0
        for prompt, group in zip(prompts, samples):
            rewards = torch.tensor([float(len(set(s))) for s in group])
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            for completion, advantage in zip(group, advantages):
                ids = torch.tensor([prompt + completion])
                logp = self.model(ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None]).squeeze(1)
                loss = -advantage * logp[len(prompt) - 1:].sum() / (len(prompts) * len(group))
                loss.backward()
                loss_total += float(loss)
        self.opt.step()
        self._sender(ModuleSource(self.model)).send_weights(weight_version=str(version))
        return loss_total

    def publish_draft(self, version: int) -> None:
        """The draft's own tensors (a stand-in for an online trainer's), as a draft round."""
        from safetensors.torch import load_file

        from vllm_specrl.sync.backends.gloo_backend import TensorSource

        tensors = load_file(str(Path(self.draft) / "model.safetensors"))
        self._sender(TensorSource(tensors)).send_weights(weight_version=str(version), draft=True)

    def captured(self) -> dict[str, int]:
        """Frames received so far, by the policy version they were captured under."""
        for header, _ in self.receiver.receive(500):
            key = str(header.get("policy_version"))
            self.frames[key] = self.frames.get(key, 0) + 1
        return dict(self.frames)

    def save(self, out: str) -> str:
        self.model.save_pretrained(out)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--draft", required=True, help="the policy's EAGLE-3 draft")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    capture = f"tcp://127.0.0.1:{free_port()}"
    engine = {"dtype": args.dtype, "enforce_eager": True, "max_model_len": 512, "seed": 0,
              "speculative_config": {"method": "eagle3", "model": args.draft, "num_speculative_tokens": 3,
                                     "draft_sample_method": "probabilistic"},
              "additional_config": {"specrl": {"capture": capture}}}
    env = {"VLLM_PLUGINS": "specrl", "VLLM_CPU_KVCACHE_SPACE": "1"}
    replicas = [EngineReplica.remote(args.policy, engine, env) for _ in range(2)]
    trainer = Trainer.remote(args.policy, args.draft, replicas, capture, args.lr)
    for r in replicas:  # capture starts once the trainer's receiver is bound
        ray.get(r.collective_rpc.remote("specrl_capture_start"))
    prompts = [[1, 450, 1217, 338], [1, 3532, 525, 263]]
    greedy = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
    report = {"steps": []}
    for step in range(1, args.steps + 1):
        rollouts = ray.get([r.generate.remote([{"prompt_token_ids": p} for p in prompts],
                                              {"n": 4, "temperature": 1.0, "max_tokens": 24, "seed": step})
                            for r in replicas])
        samples = [rollouts[0][i] + rollouts[1][i] for i in range(len(prompts))]  # both replicas' rollouts
        loss = ray.get(trainer.step.remote(prompts, samples, step))
        versions = [s["workers"][0]["sync"]["versions"] for s in ray.get([r.status.remote() for r in replicas])]
        report["steps"].append({"step": step, "loss": loss, "versions": versions})
        print(json.dumps(report["steps"][-1]), flush=True)
    ray.get(trainer.publish_draft.remote(args.steps))
    statuses = ray.get([r.status.remote() for r in replicas])
    report["versions_after_draft"] = [s["workers"][0]["sync"]["versions"] for s in statuses]
    report["spec_decode"] = [s["spec_decode"] for s in statuses]
    report["draft_mismatch"] = [s["workers"][0]["weight_watch"]["draft_mismatch"] for s in statuses]
    report["replica_greedy"] = ray.get([r.generate.remote([{"prompt_token_ids": p} for p in prompts], greedy)
                                        for r in replicas])
    report["captured_frames_by_policy_version"] = ray.get(trainer.captured.remote())
    for r in replicas:
        ray.kill(r)
    checkpoint = ray.get(trainer.save.remote(tempfile.mkdtemp(prefix="ray-fleet-policy-")))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (Path(args.policy) / name).exists():
            (Path(checkpoint) / name).write_bytes((Path(args.policy) / name).read_bytes())
    fresh = EngineReplica.remote(checkpoint, {"dtype": args.dtype, "enforce_eager": True, "max_model_len": 512},
                                 env)
    report["fresh_plain_greedy"] = ray.get(fresh.generate.remote([{"prompt_token_ids": p} for p in prompts], greedy))
    print("REPORT " + json.dumps(report), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
