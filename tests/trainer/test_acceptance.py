"""The served-acceptance estimate against a simulation of vLLM's rejection sampling.

The simulation draws drafts from q, accepts with min(1, p/q), resamples
rejections from (p - q)+, adds a bonus token when every draft is accepted, and
counts drafts and per-position acceptances exactly as vLLM's scheduler does.
The estimator only sees the emitted sequences and p, q (as the trainer does).
"""

import torch

from vllm_specrl.trainer.acceptance import StepAcceptance, served_acceptance

V, K = 6, 3


def simulate(p: torch.Tensor, q: torch.Tensor, first: int, gen: torch.Generator):
    """p [T, V]: target distribution of the token at each position (context-free toy);
    q [T, K, V]: draft distribution of step j at base s (predicting position s + 2 + j)."""
    t = p.shape[0]
    seq = [0] * t
    for pos in range(first + 1):
        seq[pos] = int(torch.multinomial(p[pos], 1, generator=gen))
    drafts, accepted = 0, [0] * K
    s = first
    while s + 2 < t:
        drafts += 1
        n, pos = 0, s + 2
        while n < K and pos < t:
            d = int(torch.multinomial(q[s, n], 1, generator=gen))
            if torch.rand((), generator=gen) <= min(1.0, float(p[pos, d] / q[s, n, d])):
                seq[pos] = d
                accepted[n] += 1
                n, pos = n + 1, pos + 1
                continue
            residual = (p[pos] - q[s, n]).clamp(min=0)
            seq[pos] = int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
            break
        else:
            if pos < t:  # every drafted token accepted: the bonus token
                seq[pos] = int(torch.multinomial(p[pos], 1, generator=gen))
        s = s + n + 1
    return seq, drafts, accepted


def estimate(seqs, p, q, first):
    b, t = len(seqs), p.shape[0]
    x = torch.tensor(seqs)
    valid, weight = [], []
    for j in range(K):
        pos = torch.arange(t) + 2 + j
        ok = (pos < t) & (torch.arange(t) >= first)
        v = ok[None].expand(b, t).clone()
        px = torch.zeros(b, t)
        qx = torch.zeros(b, t)
        for s in range(t):
            if ok[s]:
                px[:, s] = p[pos[s], x[:, pos[s]]]
                qx[:, s] = q[s, j, x[:, pos[s]]]
        valid.append(v)
        weight.append(torch.where(v, (qx / px).clamp(max=1.0), 0.0))
    return served_acceptance(StepAcceptance(valid, weight), torch.full((b,), first))


def test_estimate_matches_simulated_vllm_counters():
    gen = torch.Generator().manual_seed(0)
    t, first = 24, 5
    p = torch.distributions.Dirichlet(torch.full((V,), 0.5)).sample((t,))
    # A draft that is good early and worse at later steps, as real drafts are.
    noise = torch.distributions.Dirichlet(torch.full((V,), 0.5)).sample((t, K))
    mix = torch.tensor([0.8, 0.5, 0.3])[None, :, None]
    q = torch.zeros(t, K, V)
    for j in range(K):
        q[:, j] = p[(torch.arange(t) + 2 + j).clamp(max=t - 1)]
    q = mix * q + (1 - mix) * noise
    seqs, drafts, accepted = [], 0, [0] * K
    for _ in range(3000):
        seq, d, a = simulate(p, q, first, gen)
        seqs.append(seq)
        drafts += d
        accepted = [x + y for x, y in zip(accepted, a)]
    served = [a / drafts for a in accepted]
    est = estimate(seqs, p, q, first)
    for j in range(K):
        assert abs(est["per_position"][j] - served[j]) < 0.015, (j, est["per_position"], served)
    assert abs(est["drafts"] - drafts) / drafts < 0.01
