"""Rollout bookkeeping: every (task, sample) exactly once per step."""

import pytest

from vllm_specrl.rl.rollouts import check_rollouts


def _samples(ids):
    return [{"rollout_id": i} for i in ids]


def test_complete_step_passes():
    check_rollouts(_samples(["0/0/0", "0/0/1", "0/1/0", "0/1/1"]), step=0, tasks=2, group=2)


@pytest.mark.parametrize("ids", [["0/0/0", "0/0/1", "0/1/0"], ["0/0/0", "0/0/1", "0/1/0", "0/1/0"],
                                 ["0/0/0", "0/0/1", "0/1/0", "1/1/1"]])
def test_lost_duplicated_or_foreign_rollouts_are_refused(ids):
    with pytest.raises(RuntimeError, match="lost or duplicated"):
        check_rollouts(_samples(ids), step=0, tasks=2, group=2)
