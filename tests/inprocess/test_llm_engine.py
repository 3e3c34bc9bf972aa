"""A synchronous in-process ``LLM`` with the combined extension: capture starts from the engine's
configuration (frames reach a receiver without any RPC), outputs carry the policy version, a commit through
``sync.clients.llm.commit_update`` moves it, and the framework's own RPC answers beside the package's.

Engines: one in-process LLM in its own engine process (``in_engine_process``), shared by the module's
tests (capture, versions and the combined extension are one engine's start-up)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import in_engine_process

pytestmark = pytest.mark.server
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@in_engine_process(env={"VLLM_PLUGINS": "specrl"})
def combined_extension_engine(tiny_model: Path, moved_policy: Path, warm_draft: Path) -> dict:
    """One engine with the combined extension and capture from its configuration: two generations around a
    commit, the frames that arrived, the framework's own RPC after the commit."""
    import sys
    import time

    sys.path.insert(0, str(EXAMPLES))
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    from vllm_specrl.capture.receiver import CaptureReceiver
    from vllm_specrl.inprocess.extension import combined_extension
    from vllm_specrl.launcher import free_port
    from vllm_specrl.sync.clients import llm as llm_client

    address = f"tcp://127.0.0.1:{free_port()}"
    receiver = CaptureReceiver(address)
    llm = LLM(model=str(tiny_model), dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
              speculative_config={"method": "eagle3", "model": str(warm_draft), "num_speculative_tokens": 2},
              worker_extension_cls=combined_extension("framework_extension.FrameworkExtension"),
              additional_config={"specrl": {"capture": address, "capture_sender": "thread"}})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm_client.generate(llm, ["def f(x):", "class A:"], params, use_tqdm=False)
    frames = []
    deadline = time.time() + 60
    while time.time() < deadline and not frames:
        frames += receiver.receive(500)
    moved = load_file(str(moved_policy / "model.safetensors"))
    committed = llm_client.commit_update(llm, "policy", moved, 1)
    second = llm_client.generate(llm, ["def f(x):"], params, use_tqdm=False)
    return {"versions": [o.policy_version for o in first] + [o.policy_version for o in second],
            "frames": len(frames), "committed": committed["ok"],
            "capture": llm.collective_rpc("specrl_capture_state")[0] is not None,
            "sums": llm.collective_rpc("framework_param_sums", args=(["model.norm.weight"],))[0],
            "pushed": float(moved["model.norm.weight"].double().sum())}


@pytest.fixture(scope="module")
def outcome(tiny_model, moved_policy, warm_draft) -> dict:
    return combined_extension_engine(tiny_model, moved_policy, warm_draft)


def test_capture_started_with_the_engine_and_rows_arrived(outcome):
    assert outcome["capture"] and outcome["frames"] > 0


def test_outputs_carry_the_policy_version_and_a_commit_moves_it(outcome):
    assert outcome["committed"] and outcome["versions"] == [0, 0, 1]


def test_the_frameworks_rpc_reads_the_committed_weights(outcome):
    assert abs(outcome["sums"]["model.norm.weight"] - outcome["pushed"]) < 1e-6 * max(1.0, abs(outcome["pushed"]))
