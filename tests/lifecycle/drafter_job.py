"""An in-process engine put through what an RL job does to a drafter (run by ``test_drafter_repair`` in a
fresh interpreter): ``run(config)`` serves the tiny target with an EAGLE-3 draft and plays ``config["steps"]``,
recording after each the greedy tokens, the served acceptance (vLLM's spec-decode counters), the workers'
weight watch and the engine core's published drafter state."""

from __future__ import annotations

import json
from typing import Any

import torch


def _worker(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


def _damage(worker: Any) -> None:
    """What a discarded buffer leaves: the drafter's norm weights zeroed in place (no load, no event)."""
    with torch.no_grad():
        for module in worker.model_runner.drafter.model.modules():
            weight = getattr(module, "weight", None)
            if weight is not None and weight.numel() and type(module).__name__ == "RMSNorm":
                weight.zero_()


def _policy_to_every_runner(worker: Any, policy: dict) -> dict:
    """miles #1926's shape: a policy update aimed at every runner, the drafter's included."""
    outcome = {}
    worker.model_runner.reload_weights(weights_iterator=list(policy.items()))
    outcome["target"] = "loaded"
    try:
        worker.model_runner.drafter.model.load_weights(list(policy.items()))
        outcome["draft"] = "loaded"
    except Exception as exc:  # noqa: BLE001 - miles goes on to the next runner
        outcome["draft"] = f"refused: {exc}"
    return outcome


def run(config: dict) -> dict:
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    from vllm_specrl.instance_state import instance_dir
    from vllm_specrl.lifecycle import state as lifecycle_state
    from vllm_specrl.metrics import from_llm_metrics

    llm = LLM(model=config["target"], dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
              disable_log_stats=False, max_num_seqs=8,
              speculative_config={"method": "eagle3", "model": config["draft"], "num_speculative_tokens": 3},
              worker_extension_cls="vllm_specrl.sync.SpecRLWorkerExtension",
              weight_transfer_config={"backend": "specrl_shm"},
              additional_config={"specrl": {"drafter": config["drafter"]}})
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    worker = _worker(llm)

    def generate() -> dict:
        before = from_llm_metrics(llm.get_metrics())
        outs = llm.generate(config["prompts"], greedy, use_tqdm=False)
        served = from_llm_metrics(llm.get_metrics()).minus(before).summary()
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "served": served}

    def snapshot(**extra: Any) -> dict:
        status = llm.collective_rpc("specrl_status")[0]
        engines = lifecycle_state.read_all(instance_dir())
        return {**extra, "watch": status["weight_watch"], "versions": status["sync"]["versions"],
                "drafter": engines.get(0)}

    report: dict[str, Any] = {"steps": []}
    for step in config["steps"]:
        if step == "generate":
            report["steps"].append(snapshot(step=step, **generate()))
        elif step == "damage_rpc":
            llm.collective_rpc(_damage)
            report["steps"].append(snapshot(step=step))
        elif step == "damage_direct":
            _damage(worker)
            report["steps"].append(snapshot(step=step))
        elif step == "policy_to_every_runner":
            policy = load_file(f"{config['target']}/model.safetensors")
            outcome = llm.collective_rpc(_policy_to_every_runner, args=(policy,))[0]
            report["steps"].append(snapshot(step=step, outcome=outcome))
        elif step == "wake_after_discard":
            # vLLM #52479's shape: a wake-up after a level-2 sleep that does not reload the drafter (the CPU has
            # no sleep mode: the executor's wake-up is replaced by the discard it leaves, and vLLM's own
            # EngineCore.wake_up runs around it)
            executor = llm.llm_engine.engine_core.engine_core.model_executor
            executor.wake_up = lambda tags=None: _damage(worker)
            llm.wake_up()
            del executor.wake_up
            report["steps"].append(snapshot(step=step))
        elif step == "draft_update":
            from vllm_specrl.sync.shm import write_chunk

            path = write_chunk(load_file(f"{config['draft']}/model.safetensors"))
            llm.init_weight_transfer_engine({"init_info": {}})
            llm.start_draft_weight_update()
            llm.update_weights({"update_info": {"paths": [str(path)]}})
            llm.finish_weight_update()
            path.unlink()
            report["steps"].append(snapshot(step=step))
        else:
            raise ValueError(step)
    return report


if __name__ == "__main__":
    import sys

    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))))
