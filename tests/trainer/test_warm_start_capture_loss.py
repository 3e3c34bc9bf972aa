"""A warm start whose capture lost rollouts says so and still trains: below 90% captured whole it
computes every rollout's features with an HF forward (the ``--features hf`` path) instead of dying
on an empty training set. The engine is stubbed out: its rollouts are fixed token sequences and the
"captured" features of the kept ones are the HF features (equal to captured ones; test_captured)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm_specrl.proposer.eagle3_config import default_aux_layer_ids, read_config
from vllm_specrl.trainer import captured as captured_module
from vllm_specrl.trainer.offline import OfflineConfig, warm_start
from vllm_specrl.trainer.features import sequence_features

PROMPTS = ["def f(x):\n    return", "import os\nimport sys\n", "class A:\n    def __init__(self):",
           "for i in range(10):\n    print(", "while True:\n    x ="]
SAMPLES = 2


def _stub_capture(tiny_model, kept: int):
    """A ``captured_rollouts`` whose engine generated 10 rollouts and whose capture kept ``kept`` of them."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    gen = torch.Generator().manual_seed(0)
    everything = ([], [], [])
    for i, prompt in enumerate(PROMPTS):
        ids = tok(prompt)["input_ids"]
        for _ in range(SAMPLES):
            completion = torch.randint(10, 400, (12,), generator=gen).tolist()
            for column, value in zip(everything, (ids + completion, len(ids), i)):
                column.append(value)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    aux = tuple(default_aux_layer_ids(read_config(tiny_model)["num_hidden_layers"]))
    features = sequence_features(model, everything[0][:kept], aux, prompt_lengths=everything[1][:kept])

    def stub(target_dir, texts, samples, *args, **kwargs):
        assert len(texts) == len(PROMPTS) and samples == SAMPLES
        n = len(everything[0])
        counts = {"rollouts": n, "captured_requests": kept, "incomplete": 0, "kept": kept,
                  "sender": {"frames_offered": 3 * n, "frames_sent": 3 * kept,
                             "frames_dropped_no_peer": 3 * (n - kept)}}
        return captured_module.CapturedRollouts(everything[0][:kept], everything[1][:kept], everything[2][:kept],
                                                features, counts, everything)
    return stub


@pytest.mark.parametrize("kept, trained_on, fallback", [(0, 10, "hf"), (8, 10, "hf"), (9, 9, None)])
def test_lost_rollouts_are_reported_and_never_end_the_build(tiny_model, tmp_path, monkeypatch, capsys,
                                                            kept, trained_on, fallback):
    monkeypatch.setattr(captured_module, "captured_rollouts", _stub_capture(tiny_model, kept))
    cfg = OfflineConfig(samples_per_prompt=SAMPLES, steps=2, batch_size=4, chat=False, features="capture",
                        eval_fraction=0.2)
    summary = warm_start(tiny_model, tmp_path / "draft", prompts=PROMPTS, cfg=cfg)
    out = capsys.readouterr().out
    assert f"captured {kept} of 10 rollouts whole" in out and f"{3 * (10 - kept)} dropped (no receiver)" in out
    assert summary["rollouts"] == trained_on
    assert summary["capture"].get("fallback") == fallback
    assert ("HF forward" in out) == (fallback == "hf")
    assert (tmp_path / "draft" / "trainer_meta.json").exists()


def test_no_prompt_to_train_on_is_a_clear_error(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(captured_module, "captured_rollouts", _stub_capture(tiny_model, 10))
    cfg = OfflineConfig(samples_per_prompt=SAMPLES, steps=2, chat=False, features="capture", eval_fraction=1.0)
    with pytest.raises(ValueError, match="no rollout to train on"):
        warm_start(tiny_model, tmp_path / "draft", prompts=PROMPTS, cfg=cfg)


def test_the_capture_is_awaited_until_every_sent_frame_is_in_even_when_the_receiver_is_slow():
    """The flush waits for every frame the sender sent, however long the receiving thread takes over a
    batch: stopping at the first quiet moment (the old rule: nothing received for 0.5 s) cut the stream
    of an engine in its own process while the thread was still decoding."""
    import threading
    import time

    from vllm_specrl.trainer.captured import _wait_for_flush

    sent = 30

    class SlowDrain:
        """Takes a batch of 10 frames every 0.8 s (a batch decoded and assembled at once)."""
        received = 0
        last_frame = time.time()

    drain = SlowDrain()

    def receive():
        while drain.received < sent:
            time.sleep(0.8)
            drain.received += 10
            drain.last_frame = time.time()

    class Engine:
        def collective_rpc(self, method):
            assert method == "specrl_capture_state"
            return [{"frames_offered": sent, "frames_sent": sent, "queued": 0}]

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    state = _wait_for_flush(Engine(), drain, stall_s=10)
    assert drain.received == sent and state["frames_sent"] == sent
