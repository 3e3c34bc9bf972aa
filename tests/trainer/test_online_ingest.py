"""What the online trainer keeps of each captured request, and why it drops the rest (counted)."""

import math

import pytest
import torch

from conftest import WARM_DRAFT_VOCAB
from vllm_specrl.proposer.checkpoint import init_draft
from vllm_specrl.launcher import free_port
from vllm_specrl.trainer.online import OnlineConfig, OnlineDraftTrainer


@pytest.fixture(scope="module")
def trainer(tiny_model, tmp_path_factory):
    import json

    draft = tmp_path_factory.mktemp("ingest") / "draft"
    init_draft(tiny_model, draft, WARM_DRAFT_VOCAB, seed=1)
    hidden = json.loads((tiny_model / "config.json").read_text())["hidden_size"]
    t = OnlineDraftTrainer(draft, tiny_model, OnlineConfig(capture=f"tcp://127.0.0.1:{free_port()}"))
    t.hidden = hidden
    yield t
    t.close()


def add(t, rid, positions, version, prompt_len, recomputed=False, drafter="eagle3"):
    n, h = len(positions), t.hidden
    header = {"request_id": rid, "positions": list(positions), "token_ids": [5 + p % 50 for p in positions],
              "next_token_ids": [6 + p % 50 for p in positions], "policy_version": version,
              "num_prompt_tokens": prompt_len, "drafter": drafter}
    logprobs = [math.nan if recomputed or p < prompt_len - 1 else -0.3 for p in positions]
    tensors = {"final_hidden": torch.randn(n, h), "logprobs": torch.tensor(logprobs)}
    if drafter == "eagle3":
        tensors["aux_hidden"] = torch.randn(n, 3 * h)
    t.assembler.add(header, tensors)


def test_every_request_is_kept_or_dropped_for_a_counted_reason(trainer):
    t = trainer
    t.policy_version = 3
    add(t, "cached-sibling", range(128, 170), 3, prompt_len=150)      # prefix from the cache
    add(t, "spans-commit", range(0, 30), 2, prompt_len=10)
    add(t, "spans-commit", range(30, 60), 3, prompt_len=10)           # rows after the commit kept
    add(t, "old", range(0, 40), 2, prompt_len=10)                     # finished under the old policy
    add(t, "prompt-only", range(0, 12), 3, prompt_len=12)             # nothing drafted from it
    add(t, "recomputed", range(0, 40), 2, prompt_len=10)
    add(t, "recomputed", range(0, 40), 3, prompt_len=10, recomputed=True)  # old targets, new states
    add(t, "from-mtp-engine", range(0, 40), 3, prompt_len=10, drafter="mtp")  # no EAGLE-3 layers
    rids = ["cached-sibling", "spans-commit", "old", "prompt-only", "recomputed", "from-mtp-engine"]
    kept = {rid: t.ingest(rid) for rid in rids}
    assert kept == {"cached-sibling": True, "spans-commit": True, "old": False, "prompt-only": False,
                    "recomputed": False, "from-mtp-engine": False}
    counts = t.capture_counts()
    assert counts["ingested"] == 2 and counts["prefix_cached"] == 2 and counts["partial"] == 1
    assert counts["drops"] == {"other_policy_version": 2, "too_few_completion_rows": 1, "other_drafter": 1}
    sibling, spanning = list(t.buffer)[-2:]
    assert sibling["start"] == 128 and sibling["first_draft"] == 149 - 128 and len(sibling["token_ids"]) == 42
    assert spanning["start"] == 30 and spanning["first_draft"] == 0 and len(spanning["token_ids"]) == 30
