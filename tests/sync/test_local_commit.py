"""In-process commits (``sync.clients.llm.commit_update`` through ``vllm.LLM``) at tensor parallelism 2: all
or none across ranks. A failure planted on rank 1 while it applies leaves both ranks serving the
previous weights (greedy text equal to a single engine's on those weights, both ranks' versions
unchanged), and the next update commits on both. Planted once: the pre-fix commit (finalize whatever
the ranks answered) -> rank 0 keeps the failed update's weights and the texts differ.

Engines: one in-process `LLM(tensor_parallel_size=2)` in its own engine process, the layout under test (the
HTTP route's commit at TP 2 is tests/sync/test_tensor_parallel.py, a served engine).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import PARALLEL_MAX_TOKENS
from helpers import in_engine_process
from vllm_specrl.faults import FAULTS_ENV

pytestmark = pytest.mark.server
FAILS_ON_RANK_1 = 2  # rank 1's loader fails part way through this policy version


@in_engine_process(env={FAULTS_ENV: f"apply:policy:{FAILS_ON_RANK_1}:5@1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
                         # a fresh interpreter whose workers are spawned: two forked generations (the suite's
                         # zygote, then vLLM's executor) leave the workers waiting on each other
                         "VLLM_SPECRL_CPU_START_METHOD": "spawn", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
                         "PYTHONHASHSEED": "0"})
def three_commits_at_tp2(tiny_model: Path, moved_policy: Path, prompts: list[str]) -> dict:
    """Commit v1 (moved), v2 (the original, failing on rank 1 while it applies), v3 (the original): each
    commit's answer, the greedy texts and every rank's policy version after it."""
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    from vllm_specrl.sync.clients.llm import commit_update

    llm = LLM(model=str(tiny_model), dtype="float32", max_model_len=256, tensor_parallel_size=2,
              enforce_eager=True, seed=0, worker_extension_cls="vllm_specrl.sync.SpecRLWorkerExtension")
    params = SamplingParams(temperature=0, max_tokens=PARALLEL_MAX_TOKENS, ignore_eos=True)

    def greedy() -> list[str]:
        return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]

    def versions() -> list[int]:
        return [s["versions"]["policy"] for s in llm.collective_rpc("specrl_sync_state")]

    moved = load_file(str(moved_policy / "model.safetensors"))
    original = load_file(str(tiny_model / "model.safetensors"))
    out = {"v1": commit_update(llm, "policy", moved, 1)}
    out["after_v1"], out["versions_v1"] = greedy(), versions()
    out["v2"] = commit_update(llm, "policy", original, FAILS_ON_RANK_1)
    out["after_v2"], out["versions_v2"] = greedy(), versions()
    out["v3"] = commit_update(llm, "policy", original, 3)
    out["after_v3"], out["versions_v3"] = greedy(), versions()
    return out


@pytest.fixture(scope="module")
def outcome(tiny_model, moved_policy, parallel_prompts):
    return three_commits_at_tp2(tiny_model, moved_policy, list(parallel_prompts))


def test_a_commit_on_every_rank(outcome, single_engine_greedy):
    assert outcome["v1"]["ok"] and outcome["versions_v1"] == [1, 1]
    assert outcome["after_v1"] == single_engine_greedy["moved"]


def test_a_failure_on_one_rank_rolls_back_every_rank(outcome, single_engine_greedy):
    failed = outcome["v2"]
    assert not failed["ok"] and "failed while applying" in failed["error"], failed
    assert failed["ranks_rolled_back"] == [0], failed  # rank 0 had applied it; rank 1 restored itself
    assert outcome["versions_v2"] == [1, 1]
    assert outcome["after_v2"] == single_engine_greedy["moved"]  # both ranks serve v1 again


def test_the_next_update_commits_on_every_rank(outcome, single_engine_greedy):
    assert outcome["v3"]["ok"] and outcome["versions_v3"] == [3, 3]
    assert outcome["after_v3"] == single_engine_greedy["original"]
