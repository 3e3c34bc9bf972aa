"""``rl.serving.serve_args``: the serve arguments for each proposer and the rules behind them, read back
the way vLLM and the plugin read them. No engine starts here (the README's example and the demo serve
through these arguments)."""

from __future__ import annotations

import json

import pytest

from vllm_specrl.rl.serving import serve_args
from vllm_specrl.switches import ADAPTIVE_K_SCHEDULER, HISTORY_PROPOSER, ineffective


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_eagle3_samples_its_drafts_serves_adaptive_k_and_captures_with_the_targets():
    served = serve_args("eagle3", k=4, draft="/d", capture="tcp://127.0.0.1:5557", dtype="float32")
    spec = json.loads(flag(served.args, "--speculative-config"))
    assert spec == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 4,
                    "draft_sample_method": "probabilistic"}
    assert flag(served.args, "--scheduler-cls") == ADAPTIVE_K_SCHEDULER and served.adaptive_k
    config = json.loads(flag(served.args, "--additional-config"))["specrl"]
    assert config == {"capture": "tcp://127.0.0.1:5557", "capture_topk": 64}
    assert served.drafter == "eagle3" and flag(served.args, "--dtype") == "float32"


def test_the_history_proposer_is_served_without_adaptive_k_and_refuses_capture():
    served = serve_args("history")
    assert json.loads(flag(served.args, "--speculative-config"))["model"] == HISTORY_PROPOSER
    assert "--scheduler-cls" not in served.args and not served.adaptive_k
    with pytest.raises(ValueError, match="no draft to train"):
        serve_args("history", capture="tcp://127.0.0.1:5557")


def test_mtp_and_plain():
    mtp = serve_args("mtp", capture="tcp://127.0.0.1:5557", adaptive_k=False)
    assert json.loads(flag(mtp.args, "--speculative-config"))["method"] == "mtp" and "--scheduler-cls" not in mtp.args
    assert json.loads(flag(mtp.args, "--additional-config"))["specrl"] == {"capture": "tcp://127.0.0.1:5557"}
    plain = serve_args("plain", seed=3)
    assert plain.args == ["--seed", "3"] and plain.speculative_config is None and plain.capture is None


def test_an_eagle3_engine_needs_its_draft_and_a_proposer_must_be_known():
    with pytest.raises(ValueError, match="draft directory"):
        serve_args("eagle3")
    with pytest.raises(ValueError, match="one of"):
        serve_args("medusa")


def test_no_switch_it_sets_is_without_effect():
    class Spec:
        def __init__(self, cfg):
            self.method, self.model = cfg["method"], cfg.get("model")

    for proposer in ("eagle3", "mtp", "history"):
        served = serve_args(proposer, draft="/d", capture="tcp://127.0.0.1:1" if proposer != "history" else None,
                            additional={"history": {}} if proposer == "history" else None)
        additional = json.loads(flag(served.args, "--additional-config") or '{"specrl": {}}')["specrl"]
        assert ineffective(additional, flag(served.args, "--scheduler-cls"),
                           Spec(served.speculative_config), environ={}) == [], proposer


def test_the_command_runs_with_the_worker_extension_and_the_key():
    cmd = serve_args("eagle3", draft="/d").command("/ckpt/policy", api_key="k")
    assert cmd[:3] == ["vllm", "serve", "/ckpt/policy"] and flag(cmd, "--api-key") == "k"
    assert flag(cmd, "--worker-extension-cls") == "vllm_specrl.sync.SpecRLWorkerExtension"
