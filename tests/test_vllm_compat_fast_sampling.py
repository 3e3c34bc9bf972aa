"""vLLM's rejection sampler with the plugin's inverse-CDF samplers (fast, no engine).

The peer properties of vLLM's own rejection-sampler tests, run through vLLM's
``rejection_sample`` with ``vllm_compat.install_cpu_fast_sampling`` in place:
the emitted token follows the target distribution, the acceptance rate equals
sum min(p, q), seeded requests are reproducible; and a planted bug (recovered
tokens drawn from the target instead of max(p - q, 0)) is caught.
"""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from vllm_specrl import sampling, vllm_compat

V, N = 48, 30000
ALPHA, POWER_ALPHA = 1e-3, 1e-6


@pytest.fixture(scope="module")
def rejection_sample():
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    current_platform.register_triton_kernel_overrides()  # what every CPU worker does
    vllm_compat.install_cpu_expand_fix()
    assert vllm_compat.install_cpu_fast_sampling() == "installed"
    yield rejection_sampler.rejection_sample
    vllm_compat.uninstall_cpu_fast_sampling()


def _metadata(batch: int, generators: dict | None = None):
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.ones(batch), all_greedy=False, all_random=True, top_p=None, top_k=None,
        generators=generators or {}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=None)


def _distributions(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = (torch.randn(V, generator=gen) * 2).softmax(-1)
    q = (torch.randn(V, generator=gen) * 2).softmax(-1)
    return p, q


def _one_step(rejection_sample, p, q, with_draft_probs: bool, generators=None, seed: int = 0):
    """N requests with one draft token each, drafted from q, verified against p."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q if with_draft_probs else torch.ones(V), N, replacement=True,
                               generator=gen).to(torch.int64)
    bonus = torch.multinomial(p, N, replacement=True, generator=gen).to(torch.int64).view(-1, 1)
    torch.manual_seed(seed + 7919)  # not gen's stream: uniforms independent of the drafts
    out = rejection_sample(drafts, [1] * N, 1, torch.arange(1, N + 1, dtype=torch.int32),
                           q.expand(N, V).contiguous() if with_draft_probs else None,
                           p.log().expand(N, V).contiguous(), bonus, _metadata(N, generators))
    return drafts, out


def _fit(tokens: np.ndarray, p: torch.Tensor) -> float:
    expected = p.double().numpy() / p.double().sum().item() * len(tokens)
    return float(chisquare(np.bincount(tokens, minlength=V), expected).pvalue)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_emitted_token_follows_the_target(rejection_sample, with_draft_probs):
    p, q = _distributions()
    drafts, out = _one_step(rejection_sample, p, q, with_draft_probs)
    assert _fit(out[:, 0].numpy(), p) > ALPHA


def test_acceptance_rate_is_sum_of_min_p_q(rejection_sample):
    p, q = _distributions(1)
    drafts, out = _one_step(rejection_sample, p, q, True)
    accepted = (out[:, 1] >= 0).double().mean().item()  # the bonus token follows only an acceptance
    expected = torch.minimum(p, q).sum().item()
    assert abs(accepted - expected) < 4 * (expected * (1 - expected) / N) ** 0.5, (accepted, expected)


def test_seeded_requests_are_reproducible(rejection_sample):
    p, q = _distributions(2)

    def run(seed_of_first: int) -> torch.Tensor:
        gens = {i: torch.Generator().manual_seed(seed_of_first + i) for i in range(N)}
        return _one_step(rejection_sample, p, q, True, generators=gens, seed=3)[1]

    a, b, c = run(0), run(0), run(10 ** 6)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_a_lossy_recovery_is_caught(rejection_sample, monkeypatch):
    """Planted bug: resample a rejection from the target itself. The fit test must fail."""
    p, q = _distributions()
    monkeypatch.setattr(sampling, "residual_weights", lambda target, draft, ids: target.clone())
    _, out = _one_step(rejection_sample, p, q, True)
    assert _fit(out[:, 0].numpy(), p) < POWER_ALPHA


def test_draft_sampling_follows_softmax_of_tempered_logits(rejection_sample):
    from vllm.v1.spec_decode import llm_base_proposer

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(V, generator=gen) * 2
    meta = _metadata(N)
    meta.temperature = torch.full((N,), 0.7)
    tokens, probs = llm_base_proposer.compute_probs_and_sample_next_token(logits.expand(N, V).clone(), meta)
    want = (logits / 0.7).softmax(-1)
    assert torch.allclose(probs[0], want, atol=1e-6)
    assert _fit(tokens.numpy(), want) > ALPHA
    assert _fit(tokens.numpy(), logits.softmax(-1)) < POWER_ALPHA  # power: T=1 is told apart


def test_off_switch_leaves_vllm_alone(monkeypatch):
    monkeypatch.setenv("VLLM_SPECRL_FAST_SAMPLING", "0")
    assert vllm_compat.install_cpu_fast_sampling().startswith("off")
