"""Warm-start rollouts: every (prompt, sample) gets its own random stream under vLLM's child seeding."""

from vllm.v1.engine.parallel_sampling import ParentRequest

from vllm_specrl.trainer.rollout_seeds import WARM_START_SEED_BASE, per_prompt_sampling_params


def child_seeds(params) -> list[int]:
    """The seeds vLLM gives a request's n samples (its own parallel-sampling code, not a copy of it)."""
    parent = ParentRequest.__new__(ParentRequest)
    parent.sampling_params, parent.cached_child_sampling_params = params, None
    return [ParentRequest._get_child_sampling_params(parent, j).seed for j in range(params.n)]


def test_no_two_samples_share_a_seed_across_prompts_or_runs():
    for seed in (0, 1, 7):
        params = per_prompt_sampling_params(81, 4, 1.0, 256, seed)
        seeds = [s for p in params for s in child_seeds(p)]
        assert len(seeds) == len(set(seeds)) == 81 * 4
        assert all(p.temperature == 1.0 and p.max_tokens == 256 for p in params)
    run0 = {s for p in per_prompt_sampling_params(81, 4, 1.0, 256, 0) for s in child_seeds(p)}
    run1 = {s for p in per_prompt_sampling_params(81, 4, 1.0, 256, 1) for s in child_seeds(p)}
    assert not run0 & run1  # another --seed samples other streams


def test_warm_start_streams_are_not_the_rl_loops():
    """The demo seeds its own rollouts from 0 up (vllm_specrl.rl.rollouts): a draft must not have trained
    on the very streams the loop's first steps then sample."""
    seeds = [s for p in per_prompt_sampling_params(81, 8, 1.0, 256, 0) for s in child_seeds(p)]
    assert min(seeds) >= WARM_START_SEED_BASE > 10_000 * 64 * 16
