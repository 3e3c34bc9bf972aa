"""The history speculator's drafting on Model Runner V2, with stand-in request states: the same requests
stepped through vLLM 0.32's ``custom_class`` call (the reference) and through Model Runner V2's ``propose``
arguments must draft the same tokens; rows that draft less are padded with -1; the step's k, warm-up
calls, finished requests and the warm-up reset behave as vLLM 0.34's interface documents."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from vllm_specrl.mrv2.history_speculator import NO_DRAFT, HistoryDrafts
from vllm_specrl.proposer.history import HistoryProposer

K, MAX_LEN, SLOTS = 4, 64, 4
PROMPT = [5, 6, 7, 8]
HISTORY = {"cost_aware": False, "min_confidence": 0.01, "max_match": 4}


def _config():
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=K),
                           model_config=SimpleNamespace(max_model_len=MAX_LEN, get_vocab_size=lambda: 128, seed=0),
                           scheduler_config=SimpleNamespace(max_num_seqs=SLOTS),
                           additional_config={"specrl": {"history": HISTORY}})


class States:
    """Model Runner V2's request states as the speculator reads them (per slot)."""

    def __init__(self):
        self.all_token_ids = SimpleNamespace(gpu=torch.zeros(SLOTS, MAX_LEN, dtype=torch.int32))
        self.total_len = SimpleNamespace(gpu=torch.zeros(SLOTS, dtype=torch.int32))
        self.prompt_len = SimpleNamespace(np=np.zeros(SLOTS, dtype=np.int32))

    def put(self, slot: int, tokens: list[int]) -> None:
        self.all_token_ids.gpu[slot, :len(tokens)] = torch.tensor(tokens)
        self.total_len.gpu[slot] = len(tokens)
        self.prompt_len.np[slot] = len(PROMPT)


def _batch(req_ids, slots):
    return SimpleNamespace(num_reqs=len(req_ids), req_ids=list(req_ids), idx_mapping=torch.tensor(slots),
                           idx_mapping_np=np.array(slots))


def _reference_step(proposer, rows, k_limit=None):
    """vLLM 0.32's call: the runner's token rows, num_tokens_no_spec, and the plugin's binding."""
    ids = [rid for rid, _ in rows]
    proposer.bind_step(SimpleNamespace(req_ids=ids, num_prompt_tokens=np.full(len(rows), len(PROMPT)),
                                       temperature_cpu=None), k_limit)
    tokens = np.zeros((len(rows), MAX_LEN), dtype=np.int32)
    for i, (_, seq) in enumerate(rows):
        tokens[i, :len(seq)] = seq
    return proposer.propose([[1]] * len(rows), np.array([len(s) for _, s in rows]), tokens)


def _rollouts():
    """Two finished rollouts of one prompt, then three live siblings at different points."""
    done = [("a", PROMPT + [20, 21, 22, 23, 24, 25]), ("b", PROMPT + [20, 21, 30, 31, 32, 33])]
    live = [("c", PROMPT + [20, 21, 22]), ("d", PROMPT + [20, 21, 30]), ("e", PROMPT + [40])]
    return done, live


def test_drafts_match_the_v1_call_of_the_same_proposer():
    done, live = _rollouts()
    reference = HistoryProposer(_config())
    reference.index.cfg.sample_drafts = False
    _reference_step(reference, done)
    want = _reference_step(reference, live)   # a and b left the batch: retired into the history

    states, drafts = States(), HistoryDrafts(_config(), torch.device("cpu"), None)
    drafts.req_states = states
    for slot, (_, seq) in enumerate(done):
        states.put(slot, seq)
    drafts.propose(_batch(["a", "b"], [0, 1]), torch.tensor([1, 1]), False, None)
    drafts.finished({"a", "b"})
    slots = [3, 0, 2]   # slots in any order: a request's slot is not its row
    for slot, (_, seq) in zip(slots, live):
        states.put(slot, seq)
    got = drafts.propose(_batch([r for r, _ in live], slots), torch.tensor([1, 1, 1]), False, None)
    assert any(want), "the reference drafts nothing: the test would prove nothing"
    assert [[t for t in row if t != NO_DRAFT] for row in got.tolist()] == want
    for row, tokens in zip(got.tolist(), want):
        assert row[len(tokens):] == [NO_DRAFT] * (K - len(tokens))


def test_the_steps_k_warmup_and_rows_that_sampled_nothing():
    states, drafts = States(), HistoryDrafts(_config(), torch.device("cpu"), None)
    drafts.req_states = states
    done, live = _rollouts()
    for slot, (_, seq) in enumerate(done):
        states.put(slot, seq)
    drafts.propose(_batch(["a", "b"], [0, 1]), torch.tensor([1, 1]), False, None)
    drafts.finished({"a", "b"})
    states.put(2, live[0][1])
    batch = _batch(["c"], [2])
    assert drafts.propose(batch, torch.tensor([1]), False, None).tolist() == [[23, 24, 25, NO_DRAFT]]
    assert drafts.propose(batch, torch.tensor([1]), False, 2).tolist() == [[23, 24, NO_DRAFT, NO_DRAFT]]
    assert drafts.propose(batch, torch.tensor([0]), False, None).tolist() == [[NO_DRAFT] * K]  # mid-prefill
    assert drafts.propose(batch, torch.tensor([1]), True, None).tolist() == [[NO_DRAFT] * K]   # warm-up
    drafts.reset()   # vLLM calls it after its warm-up requests: their history is forgotten
    assert drafts.propose(batch, torch.tensor([1]), False, None).tolist() == [[NO_DRAFT] * K]
