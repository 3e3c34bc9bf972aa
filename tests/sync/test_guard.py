"""The stale-draft guard's two signals, on synthetic counters."""

from vllm_specrl.metrics import SpecDecodeCounters
from vllm_specrl.sync.http.stale_guard import StaleDraftGuard


def counters(drafts: float, accepted: float) -> SpecDecodeCounters:
    return SpecDecodeCounters(num_drafts=drafts, num_draft_tokens=3 * drafts, num_accepted_tokens=accepted)


def test_zero_acceptance_after_a_policy_update_is_stale():
    guard = StaleDraftGuard(max_version_lag=2, min_drafts=64)
    guard.policy_updated(counters(1000, 900))
    assert not guard.assess(1, 1, True, counters(1010, 900))["stale"]  # too few drafts yet
    verdict = guard.assess(1, 1, True, counters(1100, 900))
    assert verdict["stale"] and "0 draft tokens accepted over the last 100 drafts" in verdict["reasons"][0]
    assert not guard.assess(1, 1, True, counters(1100, 901))["stale"]


def test_version_lag_beyond_the_limit_is_stale():
    guard = StaleDraftGuard(max_version_lag=2, min_drafts=64)
    assert not guard.assess(2, 0, True, counters(0, 0))["stale"]
    verdict = guard.assess(3, 0, True, counters(0, 0))
    assert verdict["stale"] and verdict["version_lag"] == 3


def test_no_draft_is_never_stale():
    assert not StaleDraftGuard(0, 1).assess(9, 0, False, counters(100, 0))["stale"]


def test_mtp_layers_updated_with_the_policy_never_lag_but_can_go_stale():
    """An MTP drafter is the policy's own layers (updated by every policy commit): no version lag,
    but a refit that left them useless still shows as zero acceptance."""
    guard = StaleDraftGuard(max_version_lag=2, min_drafts=64)
    guard.policy_updated(counters(1000, 900))
    verdict = guard.assess(9, 0, True, counters(1010, 905), draft_is_policy=True)
    assert not verdict["stale"] and verdict["version_lag"] == 0
    assert guard.assess(9, 0, True, counters(1100, 900), draft_is_policy=True)["stale"]


def test_the_switches_are_read_when_a_guard_is_made_not_at_import(monkeypatch):
    monkeypatch.setenv("VLLM_SPECRL_MAX_DRAFT_LAG", "5")
    monkeypatch.setenv("VLLM_SPECRL_STALE_MIN_DRAFTS", "7")
    guard = StaleDraftGuard()
    assert (guard.max_version_lag, guard.min_drafts) == (5, 7)
    monkeypatch.delenv("VLLM_SPECRL_MAX_DRAFT_LAG")
    assert StaleDraftGuard().max_version_lag == 2
