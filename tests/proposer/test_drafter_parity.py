"""Drafter parity: the distributions vLLM's drafter computes equal ``Eagle3Draft.unroll``'s.

Read out of the running engine (the draft recorder RPC: the drafter's own
tokens and the probabilities vLLM verifies them against), float32, T=1,
k=5, the warm-started reduced-vocabulary draft. For each recorded draft the
test rebuilds the drafter's context (committed tokens, then the draft's own
earlier proposals as the chain's inputs) and runs the torch unroll on HF
features of the target. A planted mismatch (aux layers in another order) must
fail the same comparison.

Engines: three in-process engines (fixed k, varying k, parallel drafting) with the draft recorder
on: each records a drafter configuration that only an engine start sets.
"""


import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import record_drafts, sequence_of
from prompts import code_prompts
from vllm_specrl.proposer.checkpoint import load_draft
from vllm_specrl.trainer.features import target_features

K = 5
TOLERANCE = 2e-3   # total variation between the two distributions, per step


@pytest.fixture(scope="module")
def recorded(tiny_model, warm_draft, tmp_path_factory):
    prompts = code_prompts(420)[400:412]
    spec = {"method": "eagle3", "model": str(warm_draft), "num_speculative_tokens": K,
            "draft_sample_method": "probabilistic"}
    return record_drafts(tiny_model, spec, prompts, tmp_path_factory.mktemp("parity") / "drafts.pt")


def unroll_distributions(draft, target, seq: list[int], base: int, drafts: list[int],
                         aux_order: list[int] | None = None) -> torch.Tensor:
    """[k, V] draft distributions at ``base`` (k = ``len(drafts)``); the chain's inputs are the
    draft's own tokens."""
    k = len(drafts)
    ids = torch.tensor(seq[: base + 2] + drafts[: k - 1])[None]
    aux, _, _ = target_features(target, ids[:, : base + 1], draft.shape.aux_layer_ids)
    if aux_order is not None:
        aux = torch.cat([aux.chunk(len(aux_order), -1)[i] for i in aux_order], -1)
    aux = torch.cat([aux, torch.zeros(1, ids.shape[1] - base - 1, aux.shape[-1])], 1)
    with torch.no_grad():
        logits = draft.unroll(aux, ids, k)
    probs = torch.zeros(k, draft.shape.vocab_size)
    for j, step in enumerate(logits):
        probs[j, draft.draft_token_ids()] = step[0, base].softmax(-1)
    return probs


def worst_tv_per_step(recorded: dict, target, draft, planted) -> tuple[list[float], list[float]]:
    """Per draft step, the worst total variation between the recorded drafts' distributions and
    ``draft``'s unroll, and between them and ``planted(seq, base, drafts)`` (a mismatch the
    comparison must catch), over the first 40 recorded drafts of k = K tokens."""
    records = [r for r in recorded["records"] if r["draft_probs"] is not None and len(r["draft_token_ids"]) == K]
    assert len(records) > 20
    worst, planted_worst = [0.0] * K, [0.0] * K
    for r in records[:40]:
        seq = sequence_of(recorded["outputs"], r["request_id"])
        base, drafts = r["base_position"], r["draft_token_ids"]
        if base + 2 > len(seq):
            continue
        # The recorded tokens are samples of the recorded distributions (probabilistic drafting).
        for j, tok in enumerate(drafts):
            assert r["draft_probs"][j, tok] > 0, "a draft token outside its own distribution"
        ours = unroll_distributions(draft, target, seq, base, drafts)
        worst = [max(w, float(x)) for w, x in zip(worst, 0.5 * (ours - r["draft_probs"]).abs().sum(-1))]
        other = planted(seq, base, drafts)
        planted_worst = [max(w, float(x))
                         for w, x in zip(planted_worst, 0.5 * (other - r["draft_probs"]).abs().sum(-1))]
    return worst, planted_worst


def test_vllm_drafter_distributions_equal_the_torch_unroll(tiny_model, warm_draft, recorded):
    target = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    draft = load_draft(warm_draft, tiny_model).eval()
    worst, planted = worst_tv_per_step(
        recorded, target, draft,
        lambda seq, base, drafts: unroll_distributions(draft, target, seq, base, drafts, [1, 0, 2]))
    assert max(worst) < TOLERANCE, {"per_step_worst_tv": worst}
    # The same comparison catches a planted mismatch (aux layers fed in another order).
    assert min(planted) > 10 * TOLERANCE, {"planted_tv": planted}


@pytest.fixture(scope="module")
def recorded_varying_k(tiny_model, warm_draft, tmp_path_factory):
    """k follows the batch size (vLLM's table: 1 draft at 9-16 sequences, 2 at 4-8, 5 at 1-3) and
    the requests end one after another, so requests keep drafting across changes of k, as adaptive
    k makes them: the drafter's first pass after a step that verified fewer (or more) drafts must
    still start from the right rows."""
    prompts = code_prompts(440)[420:432]
    spec = {"method": "eagle3", "model": str(warm_draft), "num_speculative_tokens": K,
            "draft_sample_method": "probabilistic",
            "num_speculative_tokens_per_batch_size": [[1, 3, 5], [4, 8, 2], [9, 64, 1]]}
    return record_drafts(tiny_model, spec, prompts, tmp_path_factory.mktemp("parity-k") / "drafts.pt",
                         max_tokens=[8 + 5 * i for i in range(len(prompts))])


def test_drafter_distributions_stay_exact_when_k_changes(tiny_model, warm_draft, recorded_varying_k):
    target = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    draft = load_draft(warm_draft, tiny_model).eval()
    records = [r for r in recorded_varying_k["records"] if r["draft_probs"] is not None]
    lengths = {len(r["draft_token_ids"]) for r in records}
    assert {1, 2, K} <= lengths, lengths
    worst: dict[int, float] = {}
    for r in records[::2]:
        seq = sequence_of(recorded_varying_k["outputs"], r["request_id"])
        k = len(r["draft_token_ids"])
        if r["base_position"] + 2 > len(seq):
            continue
        ours = unroll_distributions(draft, target, seq, r["base_position"], r["draft_token_ids"])
        tv = float((0.5 * (ours - r["draft_probs"][:k]).abs().sum(-1)).max())
        worst[k] = max(worst.get(k, 0.0), tv)
    assert set(worst) == lengths and max(worst.values()) < TOLERANCE, {"worst_tv_by_k": worst}


@pytest.fixture(scope="module")
def recorded_parallel(tiny_model, parallel_draft, tmp_path_factory):
    prompts = code_prompts(460)[440:452]
    spec = {"method": "eagle3", "model": str(parallel_draft), "num_speculative_tokens": K,
            "draft_sample_method": "probabilistic", "parallel_drafting": True}
    return record_drafts(tiny_model, spec, prompts, tmp_path_factory.mktemp("parity-par") / "drafts.pt")


def test_parallel_drafting_distributions_equal_the_parallel_unroll(tiny_model, parallel_draft, recorded_parallel):
    """vLLM's parallel drafting (all k drafts from one pass over k mask slots) computes what
    ``Eagle3Draft.unroll`` trains for a parallel draft; the sequential unroll of the same weights
    (the mask ignored) does not."""
    target = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    draft = load_draft(parallel_draft, tiny_model).eval()
    assert draft.parallel
    sequential = load_draft(parallel_draft, tiny_model).eval()
    sequential.mask_token_id = None
    worst, planted = worst_tv_per_step(
        recorded_parallel, target, draft,
        lambda seq, base, drafts: unroll_distributions(sequential, target, seq, base, drafts))
    assert max(worst) < TOLERANCE, {"per_step_worst_tv": worst}
    assert planted[0] < TOLERANCE and min(planted[1:]) > 10 * TOLERANCE, {"planted_tv": planted}
