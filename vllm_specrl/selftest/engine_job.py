"""One engine of the self-test, in a process of its own: ``python -m vllm_specrl.selftest.engine_job JOB``.

``JOB`` is JSON: the engine (``model``, ``dtype``, ``speculative_config``, ``device``) and what to do with
it: ``greedy`` outputs, ``samples`` at temperature 1, ``logprobs`` (samples with their logprobs and the
prompts'), ``score`` (every token's logprob of given sequences), ``updates`` (policy and draft updates, applied
and refused), ``capture`` (rows streamed to a receiver in this process) and ``status`` (the worker's
plugin state). Prints one line ``SELFTEST <json>`` with what it found; judging is ``run``'s job.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

RESULT_TAG = "SELFTEST"


def _greedy(llm: Any, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _samples(llm: Any, prompt: str, n: int, tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([prompt] * n, params, use_tqdm=False)]


def _logprobs(llm: Any, prompts: list[str], tokens: int) -> list[dict]:
    """Samples at temperature 1 with the sampled tokens' logprobs and the prompts' logprobs, as an RL job
    asks for them (its importance ratios read them)."""
    from vllm import SamplingParams

    outs = llm.generate(prompts, [SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=100 + i,
                                                 logprobs=0, prompt_logprobs=0) for i in range(len(prompts))],
                        use_tqdm=False)
    return [{"prompt_ids": list(out.prompt_token_ids), "token_ids": list(out.outputs[0].token_ids),
             "logprobs": _token_logprobs(out.outputs[0].logprobs, out.outputs[0].token_ids),
             "prompt_logprobs": _token_logprobs(out.prompt_logprobs, out.prompt_token_ids)} for out in outs]


def _token_logprobs(steps: list, tokens: list[int]) -> list[float | None]:
    """Each token's logprob from vLLM's per-position logprob dicts (None where vLLM gives none: a prompt's
    first token)."""
    return [None if step is None else step[t].logprob for step, t in zip(steps, tokens)]


def _score(llm: Any, sequences: list[list[int]]) -> list[list[float | None]]:
    """Each token's logprob given the tokens before it (prompt logprobs over the whole sequence)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [_token_logprobs(o.prompt_logprobs, o.prompt_token_ids) for o in outs]


def _sleep_cycle(llm: Any, prompts: list[str], max_tokens: int) -> dict:
    """Greedy outputs and acceptance, then ``sleep(level=2)`` (weights discarded), ``wake_up``, the policy
    reloaded from its checkpoint (as an RL job reloads it), and the same again. Where sleep mode exists
    only (not the CPU): written against vLLM 0.32's ``LLM.sleep``/``wake_up``, not run here."""
    from vllm_specrl.metrics import summary_delta

    def served() -> dict:
        before = _spec_decode(llm)
        tokens = _greedy(llm, prompts, max_tokens)
        return {"tokens": tokens, "spec_decode": summary_delta(before, _spec_decode(llm))}

    first = served()
    llm.sleep(level=2)
    llm.wake_up()
    llm.collective_rpc("reload_weights")
    second = served()
    repairs = sum(llm.collective_rpc("specrl_weight_watch_state")[0]["repairs"].values())
    return {"before": first, "after": second, "repairs": repairs}


def _spec_decode(llm: Any) -> dict[str, float]:
    from vllm_specrl import metrics

    return metrics.from_llm_metrics(llm.get_metrics()).summary()


def perturbed(weights: dict, seed: int, scale: float = 0.3) -> dict:
    """The same tensors, every matrix moved by ``scale`` of its std (an RL step, exaggerated)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {k: (v + scale * v.float().std() * torch.randn(v.shape, generator=gen)).to(v.dtype)
            if v.is_floating_point() and v.dim() == 2 else v for k, v in weights.items()}


def _malformed(weights: dict) -> tuple[dict, str]:
    """A broken copy: the draft's ``d2t`` mapped outside the vocabulary where it has one, else the
    first matrix one row short."""
    broken = dict(weights)
    if "d2t" in broken:
        broken["d2t"] = broken["d2t"] + 10 ** 6
        return broken, "d2t outside the vocabulary"
    name = next(k for k, v in broken.items() if v.dim() == 2)
    broken[name] = broken[name][:-1].clone()
    return broken, f"{name} one row short"


def _updates(llm: Any, job: dict, prompts: list[str], max_tokens: int) -> dict:
    """Policy: a perturbed set applied (outputs move), the original set applied back (outputs return
    exactly), a malformed set refused (outputs and version stay). Draft: a fresh draft applied, a
    malformed one refused; the greedy outputs after each, for ``run`` to hold against plain vLLM's."""
    from vllm_specrl.sync.clients.llm import commit_update
    from vllm_specrl.sync.worker.validate import load_checkpoint

    def commit(target: str, tensors: dict, version: int) -> dict:
        answer = commit_update(llm, target, tensors, version)
        return {"ok": bool(answer.get("ok")), "error": answer.get("error"),
                "problems": answer.get("problems", [])[:3]}

    policy = load_checkpoint(job["model"])  # every shard; a hub id from the cache
    out: dict[str, Any] = {"before": _greedy(llm, prompts, max_tokens)}
    out["perturbed"] = commit("policy", perturbed(policy, seed=7), 1)
    out["after_perturbed"] = _greedy(llm, prompts, max_tokens)
    out["restored"] = commit("policy", policy, 2)
    out["after_restored"] = _greedy(llm, prompts, max_tokens)
    broken, out["malformed_policy_kind"] = _malformed(policy)
    out["malformed_policy"] = commit("policy", broken, 3)
    out["after_malformed_policy"] = _greedy(llm, prompts, max_tokens)
    fresh = load_checkpoint(job["fresh_draft"])
    out["draft"] = commit("draft", fresh, 1)
    out["after_draft"] = _greedy(llm, prompts, max_tokens)
    broken, out["malformed_draft_kind"] = _malformed(fresh)
    out["malformed_draft"] = commit("draft", broken, 2)
    out["after_malformed_draft"] = _greedy(llm, prompts, max_tokens)
    out["versions"] = llm.collective_rpc("specrl_sync_state")[0].get("versions")
    return out


def _capture(llm: Any, address: str, prompts: list[str], max_tokens: int) -> dict:
    """Stream the committed rows of ``prompts`` to a receiver here; per request: the tokens its
    captured rows carry, against the prompt and output tokens the engine returned."""
    from vllm import SamplingParams

    from vllm_specrl.capture.receiver import receive_while

    def generate() -> dict:
        started = llm.collective_rpc("specrl_capture_start", args=(address,))[0]
        if not started.get("ok"):
            return {"started": started}
        time.sleep(1.0)  # the sender connects
        outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
        return {"started": {"ok": True},
                "expected": [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]}

    found, sequences = receive_while(address, generate, len(prompts), settle_s=0.0)
    if not found["started"].get("ok"):
        return found
    stopped = llm.collective_rpc("specrl_capture_stop")[0]
    return {**found, "captured": [s["token_ids"].tolist() for s in sequences], "sender": stopped.get("final", {})}


def run_job(job: dict) -> dict:
    """Start the engine ``job`` describes, do what it asks, return what it found."""
    from vllm import LLM

    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), enforce_eager=True, seed=job.get("seed", 0),
              max_model_len=512, max_num_seqs=job.get("max_num_seqs", 256), disable_log_stats=False,
              **({"enable_sleep_mode": True} if job.get("sleep") else {}),
              speculative_config=job.get("speculative_config"),
              worker_extension_cls="vllm_specrl.sync.SpecRLWorkerExtension" if job.get("plugin") else "")
    result: dict[str, Any] = {}
    greedy = job.get("greedy")
    if greedy:
        result["greedy"] = _greedy(llm, greedy["prompts"], greedy["max_tokens"])
    samples = job.get("samples")
    if samples:
        result["samples"] = _samples(llm, samples["prompt"], samples["n"], samples["tokens"])
    if job.get("logprobs"):
        result["logprobs"] = _logprobs(llm, job["logprobs"]["prompts"], job["logprobs"]["tokens"])
    if job.get("score"):
        result["scored"] = _score(llm, job["score"])
    if job.get("speculative_config"):
        result["spec_decode"] = _spec_decode(llm)
    if job.get("sleep") and greedy:
        result["sleep"] = _sleep_cycle(llm, greedy["prompts"], greedy["max_tokens"])
    if job.get("updates") and greedy:
        result["updates"] = _updates(llm, job, greedy["prompts"], greedy["max_tokens"])
    if job.get("capture") and greedy:
        result["capture"] = _capture(llm, job["capture"], greedy["prompts"], greedy["max_tokens"])
    if job.get("plugin"):
        result["status"] = llm.collective_rpc("specrl_status")[0]
    return result


def main(argv: list[str] | None = None) -> int:
    job = json.loads((argv or sys.argv[1:])[0])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    result = run_job(job)
    print(f"{RESULT_TAG} {json.dumps(result)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
