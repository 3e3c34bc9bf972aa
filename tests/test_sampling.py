"""Inverse-CDF sampling (vllm_specrl.cpu.exact_sampling) draws exactly the distribution it is given."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from vllm_specrl.cpu.exact_sampling import BLOCK, inverse_cdf_sample, residual_weights, row_uniforms

ALPHA = 1e-3


def _draw(weights: torch.Tensor, n: int, seed: int) -> np.ndarray:
    """``n`` draws from one row of weights, in chunks: the sampler materialises a float32 copy of its
    ``[rows, vocab]`` input, 8 GB for 40000 rows of 49152 (3x slower than chunks, same draws)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(n, dtype=torch.float64, generator=gen)
    return torch.cat([inverse_cdf_sample(weights.expand(len(c), -1), c) for c in u.split(2000)]).numpy()


def _goodness_of_fit(samples: np.ndarray, probs: torch.Tensor) -> float:
    p = probs.double().numpy()
    expected = p / p.sum() * len(samples)
    keep = expected >= 5
    observed = np.bincount(samples, minlength=len(probs))
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("vocab", [7, BLOCK, 3 * BLOCK + 5, 49152])
def test_matches_the_weights(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=gen) * 2.5
    weights = logits.softmax(-1) * 3.0  # unnormalised on purpose
    samples = _draw(weights.unsqueeze(0), 40000, seed=1)
    assert _goodness_of_fit(samples, weights) > ALPHA


def test_a_wrong_distribution_is_rejected():
    """The goodness-of-fit check above has power: samples of a hotter distribution fail it."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(300, generator=gen) * 2.5
    hotter = _draw((logits / 1.1).softmax(-1).unsqueeze(0), 40000, seed=1)
    assert _goodness_of_fit(hotter, logits.softmax(-1)) < 1e-6


def test_zero_weight_entries_are_never_drawn():
    weights = torch.zeros(2, 5 * BLOCK)
    weights[0, [3, BLOCK + 1, 4 * BLOCK + 7]] = torch.tensor([1e-30, 0.5, 0.5])
    weights[1, 5 * BLOCK - 1] = 2.0
    u = torch.cat([torch.rand(20000, dtype=torch.float64),
                   torch.tensor([0.0, 1.0 - 2 ** -53], dtype=torch.float64)])
    got = inverse_cdf_sample(weights[0].expand(len(u), -1), u)
    assert set(got.tolist()) <= {3, BLOCK + 1, 4 * BLOCK + 7}
    assert inverse_cdf_sample(weights[1:], torch.tensor([0.999999], dtype=torch.float64)).item() == 5 * BLOCK - 1


def test_an_all_zero_row_gives_token_zero_like_vllm():
    assert inverse_cdf_sample(torch.zeros(1, 300), torch.tensor([0.5], dtype=torch.float64)).item() == 0


def test_seeded_rows_use_their_own_generator():
    def draw(seed_a: int) -> torch.Tensor:
        gens = {1: torch.Generator().manual_seed(seed_a)}
        torch.manual_seed(99)
        return row_uniforms(4, gens, [0, 1, 1, 2], torch.device("cpu"))

    a, b, c = draw(5), draw(5), draw(6)
    assert torch.equal(a, b)
    assert not torch.equal(a[1:3], c[1:3]) and torch.equal(a[[0, 3]], c[[0, 3]])


def test_residual_without_draft_probs_removes_the_draft_token():
    target = torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
    got = residual_weights(target, None, torch.tensor([1, -1]))
    assert torch.allclose(got, torch.tensor([[0.2, 0.0, 0.5], [0.1, 0.1, 0.8]]))
    draft = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    assert torch.allclose(residual_weights(target, draft, torch.tensor([0, 2])),
                          torch.tensor([[0.0, 0.0, 0.3], [0.0, 0.0, 0.0]]), atol=1e-7)
