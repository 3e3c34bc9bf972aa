"""The deferred draft-KV stash hands back each live request's held rows, contiguous and in order.

A reference is kept independently (what a drafter pass would have written per request, by
position) and compared with the replay plan row for row.
"""

import pytest
import torch

from vllm_specrl.cpu.draft_kv_stash import DraftKVStash

HIDDEN = 6


def step_tensors(req_ids: list[str], positions: list[int], salt: int):
    """A decode step's inputs, each value naming its (request, position) so misplaced rows show."""
    codes = [hash((rid, pos)) % 10_000 for rid, pos in zip(req_ids, positions)]
    ids = torch.tensor(codes, dtype=torch.int32)
    pos = torch.tensor(positions, dtype=torch.int64)
    hidden = torch.tensor(codes, dtype=torch.float32)[:, None] + torch.arange(HIDDEN) / 10
    slots = torch.tensor([c + salt for c in codes], dtype=torch.int64)
    return ids, pos, hidden, slots


def add(stash: DraftKVStash, reference: dict, req_ids: list[str], positions: list[int]) -> None:
    tensors = step_tensors(req_ids, positions, salt=7)
    stash.add_step(req_ids, positions, *tensors)
    for i, (rid, pos) in enumerate(zip(req_ids, positions)):
        reference.setdefault(rid, []).append((pos, *(t[i] for t in tensors)))


def test_replay_returns_each_live_requests_rows_in_position_order():
    stash, reference = DraftKVStash(max_rows=64), {}
    add(stash, reference, ["a", "b", "c"], [10, 20, 30])
    add(stash, reference, ["c", "a", "b"], [31, 11, 21])     # the batch was reordered
    add(stash, reference, ["a", "b"], [12, 22])              # c finished
    assert stash.rows == 8
    # The current step: b first, then a; d is new (nothing held), c is gone.
    plan = stash.take(["b", "d", "a"], [23, 0, 13])
    assert plan.batch_rows == [0, 2] and plan.query_lens == [3, 3] and plan.seq_lens == [23, 13]
    expected = reference["b"] + reference["a"]
    assert plan.positions.tolist() == [p for p, *_ in expected] == [20, 21, 22, 10, 11, 12]
    for j, name in enumerate(("token_ids", "positions", "hidden_states", "slots"), start=1):
        assert torch.equal(getattr(plan, name), torch.stack([row[j] for row in expected])), name
    counters = stash.counters
    assert counters.rows_replayed == 6 and counters.rows_dropped == 2 and counters.replays == 1
    assert counters.rows_deferred == counters.rows_replayed + counters.rows_dropped
    assert stash.rows == 0 and stash.take(["a"], [13]) is None


def test_rows_that_cannot_be_replayed_as_one_run_are_dropped():
    stash, reference = DraftKVStash(max_rows=64), {}
    add(stash, reference, ["a", "b"], [5, 7])
    add(stash, reference, ["a"], [6])          # b was not scheduled this step
    add(stash, reference, ["a", "b"], [7, 9])  # b skipped position 8: its history restarts at 9
    add(stash, reference, ["a", "b"], [0, 10])  # a was preempted and recomputed: restarts at 0
    plan = stash.take(["a", "b"], [1, 11])
    assert plan.query_lens == [1, 2] and plan.positions.tolist() == [0, 9, 10]
    assert stash.counters.rows_dropped == 4 and stash.counters.rows_replayed == 3
    # A current step that does not start right after the held rows (a recompute) replays nothing.
    add(stash, reference, ["a"], [1])
    assert stash.take(["a"], [0]) is None and stash.counters.rows_dropped == 5


def test_the_stash_is_bounded():
    stash, reference = DraftKVStash(max_rows=4), {}
    add(stash, reference, ["a", "b", "c"], [1, 1, 1])
    assert stash.fits(1) and not stash.fits(2)
    with pytest.raises(ValueError, match="flush first"):
        add(stash, reference, ["a", "b"], [2, 2])
    with pytest.raises(ValueError):
        DraftKVStash(max_rows=0)


def test_forgetting_requests_that_left_frees_their_rows_and_keeps_the_rest_replayable():
    """A full stash first drops the rows of requests no longer in the batch (and rows orphaned by a
    restart); the live requests' rows, packed, still replay exactly as held. Planted: the packed
    rows renumbered in the wrong order -> b's replayed rows are a's."""
    stash, reference = DraftKVStash(max_rows=8), {}
    add(stash, reference, ["a", "b", "c"], [10, 20, 30])
    add(stash, reference, ["c", "a", "b"], [31, 11, 21])
    add(stash, reference, ["b"], [5])                       # b restarted: its two rows are orphaned
    assert not stash.fits(2)
    assert stash.forget_absent(["b", "a"]) == 4             # c's two rows and b's orphaned two
    assert stash.rows == 3 and stash.counters.rows_dropped == 4 and stash.fits(2)
    assert stash.forget_absent(["b", "a"]) == 0
    add(stash, reference, ["a", "b"], [12, 6])
    plan = stash.take(["b", "a"], [7, 13])
    assert plan.query_lens == [2, 3] and plan.positions.tolist() == [5, 6, 10, 11, 12]
    expected = reference["b"][-2:] + reference["a"]
    for j, name in enumerate(("token_ids", "positions", "hidden_states", "slots"), start=1):
        assert torch.equal(getattr(plan, name), torch.stack([row[j] for row in expected])), name
    assert stash.counters.rows_replayed == 5 and stash.counters.rows_dropped == 4
    assert stash.counters.rows_deferred == 9
    assert stash.forget_absent([]) == 0 and stash.rows == 0


@pytest.mark.parametrize("max_rows", [1, 2, 3, 4, 5, 7, 20])
def test_a_replay_larger_than_a_pass_is_cut_into_passes_in_position_order(max_rows):
    """Each pass carries at most ``max_rows`` rows; a request cut between passes writes its first part
    first (its KV length after that pass is the part's end), and the passes together are the plan,
    row for row. Planted (a cut request's first part ending at its full length) -> the seq_lens fail."""
    stash, reference = DraftKVStash(max_rows=64), {}
    for step in range(5):
        add(stash, reference, ["a", "b", "c"], [10 + step, 40 + step, 70 + step])
    plan = stash.take(["c", "a", "b"], [75, 15, 45])
    passes = plan.passes(max_rows)
    assert all(p.num_rows <= max_rows for p in passes)
    assert len(passes) == -(-15 // max_rows)
    for name in ("token_ids", "positions", "hidden_states", "slots"):
        assert torch.equal(torch.cat([getattr(p, name) for p in passes]), getattr(plan, name)), name
    covered = {}
    for p in passes:
        at = 0
        for batch_row, rows, seq_len in zip(p.batch_rows, p.query_lens, p.seq_lens):
            # each piece is a run of one request's positions ending right before its KV length
            assert p.positions[at:at + rows].tolist() == list(range(seq_len - rows, seq_len))
            covered.setdefault(batch_row, []).extend(range(seq_len - rows, seq_len))
            at += rows
    assert covered == {0: list(range(70, 75)), 1: list(range(10, 15)), 2: list(range(40, 45))}
    with pytest.raises(ValueError):
        plan.passes(0)
