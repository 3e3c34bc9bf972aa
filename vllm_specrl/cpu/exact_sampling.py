"""Exact categorical sampling from one uniform per row, for speculative decoding on CPU.

vLLM samples draft tokens and rejection-recovered tokens with the exponential
race (``argmax(p / q)``, ``q ~ Exp(1)`` over the whole vocabulary). On a CPU
one exponential variate costs a random draw and a logarithm, per vocabulary
entry per row: at a large vocabulary, more than the drafter's forward.
Inverse-CDF sampling draws the same distribution from one uniform per row and
costs a few passes of cheap arithmetic. It is done in two levels (block sums,
then one block) so that the cumulative sums are short and accumulate in
float64: a single float32 cumsum over 49k entries would perturb each token's
probability by up to an ulp of the running total (about 3e-8 absolute, a
total-variation error near 1e-3 summed over the vocabulary).

Nothing here imports vLLM; ``cpu_patches`` binds these functions in place of
vLLM's where (version, platform) the exponential race is what a step costs.
"""

from __future__ import annotations

import torch

BLOCK = 128


def _blocked(weights: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` -> ``[N, ceil(V / BLOCK), BLOCK]``, zero-padded."""
    n, v = weights.shape
    pad = (-v) % BLOCK
    if pad:
        weights = torch.nn.functional.pad(weights, (0, pad))
    return weights.reshape(n, -1, BLOCK)


def inverse_cdf_sample(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index ``i`` of each row with probability ``weights[i] / weights.sum()``.

    ``weights``: ``[N, V]``, non-negative, need not be normalised (a row of zeros
    returns 0, as vLLM's argmax does). ``uniforms``: ``[N]`` in ``[0, 1)``,
    float64 for full resolution. Zero-weight entries are never returned.
    """
    n, v = weights.shape
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=weights.device)
    blocks = _blocked(weights.float())
    block_mass = blocks.sum(dim=-1, dtype=torch.float64)              # [N, nb]
    cum_blocks = block_mass.cumsum(dim=-1)
    total = cum_blocks[:, -1]
    target = uniforms.to(torch.float64) * total                        # [N]
    block = torch.searchsorted(cum_blocks, target.unsqueeze(1), right=True).squeeze(1)
    block = block.clamp_(max=cum_blocks.shape[1] - 1)
    rows = torch.arange(n, device=weights.device)
    before = torch.where(block > 0, cum_blocks[rows, (block - 1).clamp(min=0)], torch.zeros_like(total))
    inner = blocks[rows, block].to(torch.float64)                       # [N, BLOCK]
    cum_inner = inner.cumsum(dim=-1)
    offset = torch.searchsorted(cum_inner, (target - before).unsqueeze(1), right=True).squeeze(1)
    # Rounding between the block's mass and its own cumsum can step past the end:
    # take the block's last entry with weight instead (never a zero-weight one).
    last_nonzero = BLOCK - 1 - (inner > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    offset = torch.minimum(offset, last_nonzero)
    index = block * BLOCK + offset
    return torch.where(total > 0, index, torch.zeros_like(index)).clamp_(max=v - 1)


def row_uniforms(num_rows: int, generators: dict[int, torch.Generator] | None,
                 row_owner: list[int] | None, device: torch.device) -> torch.Tensor:
    """One float64 uniform per row: from the owning request's generator when it has one
    (seeded requests stay reproducible), else from the global generator in one call."""
    u = torch.rand(num_rows, dtype=torch.float64, device=device)
    if generators:
        owners = row_owner if row_owner is not None else list(range(num_rows))
        for row, req in enumerate(owners):
            gen = generators.get(req)
            if gen is not None:
                u[row] = torch.rand(1, dtype=torch.float64, generator=gen, device=device)[0]
    return u


def residual_weights(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     draft_token_ids: torch.Tensor) -> torch.Tensor:
    """What a rejected draft position resamples from: ``max(p - q, 0)``; without draft
    probabilities (drafts given as token ids, q one-hot) the target with the draft token removed."""
    if draft_probs is not None:
        return (target_probs - draft_probs).clamp_(min=0.0)
    weights = target_probs.clone()
    valid = draft_token_ids >= 0
    rows = torch.arange(weights.shape[0], device=weights.device)[valid]
    weights[rows, draft_token_ids[valid].long()] = 0.0
    return weights


def spread_draft_probs(draft_probs: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft distributions over a reduced vocabulary (``[..., draft_vocab]``, column ``j`` the
    probability of target token ``vocab_ids[j]``) as rows over the target's ``vocab_size``."""
    full = draft_probs.new_zeros((*draft_probs.shape[:-1], vocab_size))
    full[..., vocab_ids] = draft_probs
    return full


def _draft_prob_at(draft_probs: torch.Tensor, token_ids: torch.Tensor,
                   draft_vocab_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """``q(token)`` per row; with ``draft_vocab_ids`` the rows are over the draft's vocabulary and a
    token outside it has probability 0."""
    rows = torch.arange(token_ids.shape[0], device=token_ids.device)
    if draft_vocab_ids is None:
        return draft_probs[rows, token_ids].float()
    column = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_vocab_ids.device)
    column[draft_vocab_ids] = torch.arange(draft_vocab_ids.shape[0], device=draft_vocab_ids.device)
    at = column[token_ids]
    return torch.where(at >= 0, draft_probs[rows, at.clamp(min=0)].float(), 0.0)


def rejection_sample_lazily(draft_token_ids: torch.Tensor, num_draft_tokens: list[int], max_spec_len: int,
                            target_logits: torch.Tensor, draft_probs: torch.Tensor | None,
                            bonus_token_ids: torch.Tensor, uniform_probs: torch.Tensor,
                            generators: dict[int, torch.Generator] | None,
                            is_greedy: torch.Tensor | None = None) -> torch.Tensor:
    """Speculative rejection sampling that draws a recovered token only where one is emitted.

    The algorithm of vLLM's ``rejection_sample`` (Leviathan et al.): draft ``d`` at a position is
    accepted when ``p(d) / q(d) >= u`` (``q`` one-hot for token-id drafts, a padded ``-1`` draft is
    rejected), the first rejected position emits a token drawn from ``max(p - q, 0)``, and a request
    whose drafts are all accepted emits its bonus token. vLLM draws a recovered token for *every*
    draft row over the full vocabulary before it knows which rows are rejected; only the first
    rejected row of each request is ever emitted, so here acceptance reads ``p(d)`` per row and the
    residual is formed and sampled only at those rows. Same law: a recovered token is independent
    of everything but its row's ``p`` and ``q``.

    ``target_logits``: ``[rows, V]`` after temperature and other constraints. ``uniform_probs``:
    ``[rows]``, the acceptance draws (vLLM's ``generate_uniform_probs``). Recovered tokens draw one
    uniform each from the request's generator when it has one. ``is_greedy`` (``[batch]``, optional):
    requests verified greedily, as vLLM does (a draft is accepted when it is the target's argmax,
    which a rejection emits). Returns ``[batch, max_spec_len + 1]`` int32, ``-1`` where nothing is
    emitted.
    """
    batch = len(num_draft_tokens)
    out = torch.full((batch, max_spec_len + 1), -1, dtype=torch.int32, device=target_logits.device)
    bonus = bonus_token_ids.view(-1).to(torch.int32)
    rows = draft_token_ids.shape[0]
    if rows == 0:
        out[:, 0] = bonus
        return out
    target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)  # vLLM's; a third of a logsumexp's cost
    ids = draft_token_ids.long()
    safe = ids.clamp(min=0)
    row_index = torch.arange(rows, device=target_probs.device)
    p_draft = target_probs[row_index, safe]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs[row_index, safe].float()
    # As vLLM's CPU kernel compares: float32 ratio against the float32-rounded uniform.
    accepted = (ids >= 0) & (q_draft > 0) & (p_draft / q_draft >= uniform_probs.to(torch.float32))

    counts = torch.tensor(num_draft_tokens, dtype=torch.long)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(rows) - torch.repeat_interleave(starts, counts)
    owner = torch.repeat_interleave(torch.arange(batch), counts)
    greedy = torch.zeros(batch, dtype=torch.bool) if is_greedy is None else is_greedy.cpu().bool()
    target_argmax = None
    if bool(greedy.any()):
        target_argmax = target_logits.argmax(dim=-1)
        accepted = torch.where(greedy[owner].to(accepted.device), ids == target_argmax, accepted)
    rejected = ~accepted.cpu()
    # First rejected position per request (num_draft_tokens when none is).
    first = counts.clone()
    first.scatter_reduce_(0, owner[rejected], position[rejected], reduce="amin")
    emitted = position < first[owner]                      # accepted drafts before the first rejection
    out[owner[emitted], position[emitted]] = ids[emitted.to(ids.device)].to(torch.int32)
    done = first == counts
    out[torch.arange(batch)[done], counts[done]] = bonus[done.to(bonus.device)]

    failed_greedy = torch.nonzero(~done & greedy).view(-1)
    if failed_greedy.numel():
        at = (starts[failed_greedy] + first[failed_greedy]).to(target_probs.device)
        out[failed_greedy, first[failed_greedy]] = target_argmax[at].to(torch.int32)
    failed = torch.nonzero(~done & ~greedy).view(-1)
    if failed.numel():
        at = (starts[failed] + first[failed]).to(target_probs.device)
        weights = residual_weights(target_probs[at], None if draft_probs is None else draft_probs[at].float(), ids[at])
        uniforms = row_uniforms(len(failed), generators, failed.tolist(), target_probs.device)
        out[failed, first[failed]] = inverse_cdf_sample(weights, uniforms).to(torch.int32)
    return out


def verify_in_one_pass(logits: torch.Tensor, target_rows: torch.Tensor, bonus_rows: torch.Tensor,
                       draft_token_ids: torch.Tensor, num_draft_tokens: list[int], max_spec_len: int,
                       draft_probs: torch.Tensor | None, temperature: torch.Tensor | None,
                       acceptance_uniforms: torch.Tensor,
                       generators: dict[int, torch.Generator] | None,
                       draft_vocab_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify step of sampled requests from one log-softmax over the step's logits.

    ``rejection_sample_lazily``'s algorithm, with the bonus token drawn only for the requests that
    emit one (those whose drafts were all accepted; vLLM samples one for every request first) and
    every probability read from a single ``log_softmax`` of all the step's rows, in place of the
    copies vLLM makes around the rejection sampler (bonus rows, target rows, a float32 copy and a
    clone of them, the softmax, and for logprobs the emitted rows again). Same law: the emitted token
    at a position is accepted with ``min(1, p/q)``, else drawn from ``max(p - q, 0)``; after all
    drafts, from ``p``.

    ``logits``: ``[rows, V]``, a step's rows in vLLM's layout (each request's draft rows, then its
    bonus row, at ``target_rows`` / ``bonus_rows``). ``temperature``: ``[batch]`` (> 0), or None
    for 1. ``acceptance_uniforms``: ``[draft rows]``. ``draft_vocab_ids`` (``[draft_vocab]``): the
    target token of each column of ``draft_probs`` when those are over a reduced draft vocabulary
    (kept compact from the drafter to here: only the drafted token's column and the rejected rows
    are read, where spreading every row over the target's vocabulary cost copies of
    ``[rows, V]``). Returns the emitted tokens,
    ``[batch, max_spec_len + 1]`` int32 with ``-1`` where nothing is emitted, and the ``[rows, V]``
    float32 log-probabilities of ``logits / T``.
    """
    batch = len(num_draft_tokens)
    counts = torch.tensor(num_draft_tokens, dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(batch), counts)
    t_rows, b_rows = target_rows.long(), bonus_rows.long()
    if temperature is not None and not bool((temperature == 1).all()):
        row_temperature = torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
        row_temperature[t_rows] = temperature[owner.to(temperature.device)].float()
        row_temperature[b_rows] = temperature.float()
        logp = (logits.float() / row_temperature.unsqueeze(1)).log_softmax(dim=-1)
    else:
        logp = logits.log_softmax(dim=-1, dtype=torch.float32)
    out = torch.full((batch, max_spec_len + 1), -1, dtype=torch.int32, device=logits.device)
    rows = draft_token_ids.shape[0]
    ids = draft_token_ids.long()
    starts = torch.cumsum(counts, 0) - counts
    first = counts.clone()  # first rejected position per request (num_draft_tokens when none is)
    if rows:
        safe = ids.clamp(min=0)
        p_draft = logp[t_rows, safe].exp()
        q_draft = (torch.ones_like(p_draft) if draft_probs is None
                   else _draft_prob_at(draft_probs, safe, draft_vocab_ids, logits.shape[-1]))
        # As vLLM's CPU kernel compares: float32 ratio against the float32-rounded uniform.
        accepted = (ids >= 0) & (q_draft > 0) & (p_draft / q_draft >= acceptance_uniforms.to(torch.float32))
        rejected = ~accepted.cpu()
        position = torch.arange(rows) - torch.repeat_interleave(starts, counts)
        first.scatter_reduce_(0, owner[rejected], position[rejected], reduce="amin")
        emitted = position < first[owner]  # accepted drafts before the first rejection
        out[owner[emitted], position[emitted]] = ids[emitted.to(ids.device)].to(torch.int32)
    done = first == counts
    failed = torch.nonzero(~done).view(-1)
    if failed.numel():
        at = (starts[failed] + first[failed]).to(logits.device)
        q_rows = None
        if draft_probs is not None:
            q_rows = draft_probs[at].float()
            if draft_vocab_ids is not None:
                q_rows = spread_draft_probs(q_rows, draft_vocab_ids, logits.shape[-1])
        weights = residual_weights(logp[t_rows[at]].exp(), q_rows, ids[at])
        uniforms = row_uniforms(len(failed), generators, failed.tolist(), logits.device)
        out[failed, first[failed]] = inverse_cdf_sample(weights, uniforms).to(torch.int32)
    finished = torch.nonzero(done).view(-1)
    if finished.numel():
        uniforms = row_uniforms(len(finished), generators, finished.tolist(), logits.device)
        bonus = inverse_cdf_sample(logp[b_rows[finished.to(b_rows.device)]].exp(), uniforms)
        out[finished, counts[finished]] = bonus.to(torch.int32)
    return out, logp
