"""vLLM's rejection sampler with the plugin's inverse-CDF samplers (fast, no engine).

The peer properties of vLLM's own rejection-sampler tests, run through vLLM's
``rejection_sample`` with ``cpu_patches.install_cpu_fast_sampling`` in place:
the emitted token follows the target distribution, the acceptance rate equals
sum min(p, q), seeded requests are reproducible; and a planted bug (recovered
tokens drawn from the target instead of max(p - q, 0)) is caught.
"""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from vllm_specrl.cpu import exact_sampling as sampling
from vllm_specrl.compat import cpu_expand_kernel
from vllm_specrl.compat.registry import REGISTRY
from vllm_specrl.cpu import sampling_patches as cpu_patches
from vllm_specrl.cpu import samplers as cpu_samplers

V, N = 48, 30000
ALPHA, POWER_ALPHA = 1e-3, 1e-6


@pytest.fixture(scope="module")
def installed():
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    current_platform.register_triton_kernel_overrides()  # what every CPU worker does
    cpu_expand_kernel.install_cpu_expand_fix()
    assert cpu_patches.install_cpu_fast_sampling() == "installed"
    yield rejection_sampler
    cpu_patches.uninstall_cpu_fast_sampling()


@pytest.fixture(scope="module", params=["lazy_recovery", "vllm_kernel_with_inverse_cdf"])
def rejection_sample(installed, request):
    """Both paths a sampled batch can take: the plugin's (recovered tokens only where emitted),
    and vLLM's own kernel with the inverse-CDF recovered sampler (what all-greedy batches and
    VLLM_SPECRL_LAZY_REJECTION=0 take)."""
    if request.param == "lazy_recovery":
        return installed.rejection_sample
    return REGISTRY.original(cpu_samplers.LAZY_REJECTION)


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
    from vllm.v1.sample import rejection_sampler

    was_installed = REGISTRY.is_installed(cpu_samplers.LAZY_REJECTION)
    cpu_patches.uninstall_cpu_fast_sampling()
    stock = rejection_sampler.rejection_sample, rejection_sampler.RejectionSampler.forward
    monkeypatch.setenv("VLLM_SPECRL_FAST_SAMPLING", "0")
    result = cpu_patches.install_cpu_fast_sampling()
    assert result.startswith("0 of 6 installed") and "VLLM_SPECRL_FAST_SAMPLING=0" in result, result
    assert (rejection_sampler.rejection_sample, rejection_sampler.RejectionSampler.forward) == stock
    monkeypatch.delenv("VLLM_SPECRL_FAST_SAMPLING")
    if was_installed:
        assert cpu_patches.install_cpu_fast_sampling() == "installed"


def _ragged_batch(seed: int, with_draft_probs: bool):
    """12 requests with 0-3 drafts (one padded with -1), peaked targets so that acceptances
    run several positions deep and rejections fall at every position."""
    gen = torch.Generator().manual_seed(seed)
    counts = [3, 0, 1, 2, 3, 3, 1, 0, 2, 3, 3, 1]
    rows = sum(counts)
    target_logits = torch.randn(rows, V, generator=gen) * 3
    draft_probs = (target_logits + torch.randn(rows, V, generator=gen)).softmax(-1)
    drafts = torch.multinomial(draft_probs, 1, generator=gen).view(-1).to(torch.int32)
    drafts[4] = -1
    bonus = torch.randint(0, V, (len(counts), 1), generator=gen)
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    return counts, drafts, cu, draft_probs if with_draft_probs else None, target_logits, bonus


GREEDY_REQUESTS = (1, 5, 9)


@pytest.mark.parametrize("with_draft_probs", [True, False])
@pytest.mark.parametrize("batch", ["sampled", "mixed"])
def test_lazy_recovery_accepts_exactly_where_vllms_kernel_does(installed, with_draft_probs, batch):
    """Same acceptance draws (one global seed), so the accepted prefixes, the position of the first
    rejection and the bonus tokens must equal vLLM's kernel token for token; only a sampled request's
    recovered token is drawn differently. Greedy requests beside sampled ones: identical rows."""
    agree = rejected = 0
    for seed in range(40):
        counts, drafts, cu, q, logits, bonus = _ragged_batch(seed, with_draft_probs)
        meta = _metadata(len(counts))
        if batch == "mixed":
            meta.temperature[list(GREEDY_REQUESTS)] = 0.0
            meta.all_random = False
        outs = []
        for fn in (installed.rejection_sample, REGISTRY.original(cpu_samplers.LAZY_REJECTION)):
            torch.manual_seed(1000 + seed)
            outs.append(fn(drafts, counts, 3, cu, q, logits.clone(), bonus, meta))
        lazy, stock = outs
        # Request 3's first draft is a padded -1: rejected there, as vLLM's Triton kernel does (its
        # CPU kernel reads the padded id as a token and can accept it: not compared).
        assert lazy[3, 0] >= 0 and (lazy[3, 1:] == -1).all()
        keep = torch.arange(len(counts)) != 3
        lazy, stock, counts = lazy[keep], stock[keep], counts[:3] + counts[4:]
        greedy = [r - (r > 3) for r in GREEDY_REQUESTS] if batch == "mixed" else []
        assert torch.equal(lazy >= 0, stock >= 0)
        for r, n in enumerate(counts):
            emitted = int((stock[r] >= 0).sum())
            if emitted <= n and r not in greedy:  # rejected at position emitted - 1: all before it equal
                rejected += 1
                assert torch.equal(lazy[r, :emitted - 1], stock[r, :emitted - 1])
            else:
                assert torch.equal(lazy[r], stock[r]), (r, lazy[r], stock[r])
            agree += 1
    assert rejected > 60 and agree - rejected > 100  # both outcomes exercised


def _verify_metadata(counts: list[int], drafts: torch.Tensor):
    """A verify step's layout as vLLM's runner builds it: per request its draft rows, then its bonus row.
    Returns (SpecDecodeMetadata, draft rows, bonus rows)."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    target_rows, bonus_rows, row = [], [], 0
    for n in counts:
        target_rows += list(range(row, row + n))
        bonus_rows.append(row + n)
        row += n + 1
    i32 = torch.int32
    meta = SpecDecodeMetadata(
        draft_token_ids=drafts, num_draft_tokens=counts, cu_num_draft_tokens=torch.tensor(counts).cumsum(0).to(i32),
        cu_num_sampled_tokens=(torch.tensor(counts) + 1).cumsum(0).to(i32),
        target_logits_indices=torch.tensor(target_rows, dtype=i32),
        bonus_logits_indices=torch.tensor(bonus_rows, dtype=i32), logits_indices=torch.arange(row, dtype=i32))
    return meta, target_rows, bonus_rows


def _logprobs_case(seed: int):
    counts = [2, 0, 3, 1, 2]
    gen = torch.Generator().manual_seed(seed)
    meta, _, _ = _verify_metadata(counts, torch.zeros(sum(counts), dtype=torch.int32))
    logits = torch.randn(meta.logits_indices.shape[0], V, generator=gen) * 2
    sampled = torch.full((len(counts), 4), -1, dtype=torch.int32)
    for r, n in enumerate(counts):
        emitted = int(torch.randint(1, n + 2, (1,), generator=gen))
        sampled[r, :emitted] = torch.randint(0, V, (emitted,), generator=gen, dtype=torch.int32)
    return meta, logits, sampled


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_emitted_logprobs_equal_vllms(installed, mode):
    """Top-k, sampled-token logprob and rank of every emitted token as vLLM computes them."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    sampler = RejectionSampler(Sampler(logprobs_mode=mode))
    for seed in range(5):
        meta, logits, sampled = _logprobs_case(seed)
        target = logits[meta.target_logits_indices.long()] * 0.9  # distinct from the raw rows: read from here
        bonus = logits[meta.bonus_logits_indices.long()] * 1.1
        got = RejectionSampler._get_logprobs_tensors(sampler, 3, meta, logits, target, bonus, sampled)
        want = REGISTRY.original(cpu_samplers.EMITTED_LOGPROBS)(sampler, 3, meta, logits, target, bonus, sampled)
        valid = (sampled.flatten() >= 0)
        assert int(valid.sum()) >= len(meta.num_draft_tokens)
        assert torch.equal(got.logprob_token_ids[valid], want.logprob_token_ids[valid])
        assert torch.allclose(got.logprobs[valid], want.logprobs[valid], atol=1e-5)
        assert torch.equal(got.selected_token_ranks[valid], want.selected_token_ranks[valid])


def test_lazy_rejection_off_switch_keeps_only_the_inverse_cdf_samplers(installed, monkeypatch):
    stock = REGISTRY.original(cpu_samplers.LAZY_REJECTION)
    cpu_patches.uninstall_cpu_fast_sampling()
    monkeypatch.setenv(cpu_samplers.LAZY_REJECTION_ENV, "0")
    try:
        result = cpu_patches.install_cpu_fast_sampling()
        assert result.startswith("3 of 6 installed") and f"{cpu_samplers.LAZY_REJECTION_ENV}=0" in result, result
        assert installed.rejection_sample is stock
        assert installed.sample_recovered_tokens is cpu_samplers.fast_recovered_sample
    finally:
        cpu_patches.uninstall_cpu_fast_sampling()
        monkeypatch.delenv(cpu_samplers.LAZY_REJECTION_ENV)
        assert cpu_patches.install_cpu_fast_sampling() == "installed"
    assert installed.rejection_sample is cpu_samplers.fast_rejection_sample


def _reduced_vocab_drafter(draft_vocab: int, vocab: int, hidden: int = 16, seed: int = 5):
    """A drafter whose model is shaped like vLLM's ``Eagle3LlamaForCausalLM`` with a reduced vocabulary:
    its own ``compute_logits`` (the ``-inf`` spread over the target's vocabulary), an LM head over
    ``draft_vocab`` tokens and a ``draft_id_to_target_id`` offset table; nothing else of a proposer."""
    from types import SimpleNamespace

    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    gen = torch.Generator().manual_seed(seed)
    mapped = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    model = SimpleNamespace(
        lm_head=torch.randn(draft_vocab, hidden, generator=gen) * 0.7,
        logits_processor=lambda head, h: h @ head.T,
        draft_id_to_target_id=mapped - torch.arange(draft_vocab),
        config=SimpleNamespace(vocab_size=vocab, draft_vocab_size=draft_vocab))
    model.compute_logits = lambda h: Eagle3LlamaForCausalLM.compute_logits(model, h)
    drafter = object.__new__(SpecDecodeBaseProposer)
    drafter.model, drafter.use_heterogeneous_vocab, drafter.parallel_drafting = model, False, False
    drafter._enable_probabilistic_draft_probs, drafter.use_fp64_gumbel = True, False
    drafter.use_local_argmax_reduction = False
    return drafter, mapped, torch.randn(1, hidden, generator=gen) * 3


def test_reduced_vocab_draft_is_sampled_in_its_own_vocabulary(installed):
    """The draft-vocabulary path against vLLM's own spread-then-sample on the same drafter: the same
    target-vocabulary probabilities (what the rejection sampler reads; kept over the draft's
    vocabulary while the one-pass verify reads them), tokens only from the mapped ids (the draft id
    used as a target id fails here) and distributed as those probabilities."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    drafter, mapped, h = _reduced_vocab_drafter(draft_vocab=V // 2, vocab=3 * V)
    assert SpecDecodeBaseProposer._sample_draft_tokens is cpu_samplers.draft_vocab_sample_draft_tokens
    meta = _metadata(N)
    meta.temperature = torch.full((N,), 0.8)
    hidden = h.expand(N, -1).contiguous()
    tokens, compact = drafter._sample_draft_tokens(hidden, meta)
    _, stock_probs = REGISTRY.original(cpu_samplers.DRAFT_VOCAB)(drafter, hidden.clone(), meta)
    assert compact.shape == (N, V // 2) and stock_probs.shape == (N, 3 * V)
    probs = cpu_samplers.full_draft_probs(compact, 3 * V)
    assert torch.allclose(probs, stock_probs, atol=1e-7, rtol=1e-5)
    assert bool(torch.isin(tokens, mapped).all())
    expected = stock_probs[0].double().numpy() * N
    counts = np.bincount(tokens.numpy(), minlength=3 * V)[mapped.numpy()]
    assert chisquare(counts, expected[mapped.numpy()]).pvalue > ALPHA


def test_reduced_vocab_draft_probs_are_spread_when_vllms_forward_verifies(installed, monkeypatch):
    """Compact rows are for the one-pass verify only: with it off (or the switch set) the drafter
    hands vLLM's forward rows over the target's vocabulary, the same as the compact ones spread."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    drafter, _, h = _reduced_vocab_drafter(draft_vocab=V // 2, vocab=3 * V)
    hidden = h.expand(4, -1).contiguous()
    torch.manual_seed(0)
    tokens, compact = drafter._sample_draft_tokens(hidden, _metadata(4))
    assert compact.shape == (4, V // 2)
    for switch in ("env", "one_pass_off"):
        with monkeypatch.context() as patch:
            if switch == "env":
                patch.setenv(cpu_samplers.COMPACT_DRAFT_PROBS_ENV, "0")
            else:
                REGISTRY.uninstall(cpu_samplers.ONE_PASS_VERIFY)
            torch.manual_seed(0)
            spread_tokens, spread = drafter._sample_draft_tokens(hidden, _metadata(4))
        if switch == "one_pass_off":
            assert cpu_patches.install_cpu_fast_sampling() == "installed"
            assert RejectionSampler.forward is cpu_samplers.one_pass_rejection_forward
        assert torch.equal(spread_tokens, tokens)
        assert torch.equal(spread, cpu_samplers.full_draft_probs(compact, 3 * V))


def test_reduced_vocab_draft_keeps_vllms_path_where_it_is_not_sampled(installed):
    """Greedy batches and drafts without a reduced vocabulary go through vLLM's own method."""
    drafter, _, h = _reduced_vocab_drafter(draft_vocab=V // 2, vocab=3 * V)
    meta = _metadata(4)
    meta.temperature, meta.all_greedy, meta.all_random = torch.zeros(4), True, False
    tokens, probs = drafter._sample_draft_tokens(h.expand(4, -1).contiguous(), meta)
    assert probs is None and torch.equal(tokens, drafter.model.compute_logits(h).argmax(-1).expand(4))
    drafter.model.draft_id_to_target_id = None
    drafter.model.lm_head = torch.randn(3 * V, h.shape[1])
    meta = _metadata(4)
    tokens, probs = drafter._sample_draft_tokens(h.expand(4, -1).contiguous(), meta)
    assert probs.shape == (4, 3 * V)


def _verify_step(counts: list[int], target: torch.Tensor, bonus: torch.Tensor, q: torch.Tensor | None,
                 seed: int, temperature: float = 1.0, logprobs: int | None = None, generators=None):
    """A verify step through ``RejectionSampler.forward`` in vLLM's layout (each request's draft rows, then
    its bonus row): draft rows score ``target``, bonus rows ``bonus`` (logits, ``[V]`` each), drafts are
    drawn from ``q`` (uniformly where it is None: token-id drafts). Returns (output, logprobs, logits)."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q if q is not None else torch.ones(V), sum(counts), replacement=True,
                               generator=gen).to(torch.int32)
    meta, target_rows, bonus_rows = _verify_metadata(counts, drafts)
    logits = torch.empty(meta.logits_indices.shape[0], V)
    logits[target_rows] = target
    logits[bonus_rows] = bonus
    sampling = _metadata(len(counts), generators)
    sampling.temperature = torch.full((len(counts),), temperature)
    sampling.max_num_logprobs = logprobs
    torch.manual_seed(seed + 7919)
    out = RejectionSampler(Sampler())(meta, None if q is None else q.expand(sum(counts), V).contiguous(),
                                      logits.clone(), sampling)
    return out.sampled_token_ids, out.logprobs_tensors, logits


@pytest.fixture
def one_pass_calls(installed, monkeypatch):
    """How many verify steps went through ``sampling.verify_in_one_pass``."""
    calls = []
    real = sampling.verify_in_one_pass
    monkeypatch.setattr(sampling, "verify_in_one_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_one_pass_verify_emits_the_target_at_every_position(one_pass_calls, with_draft_probs):
    """One draft per request: the first token follows the draft rows' target p (accepted with sum
    min(p, q)), the bonus token after an acceptance follows the bonus row's own distribution, which
    differs here so that reading the wrong row fails."""
    p, q = _distributions(5)
    p_bonus, _ = _distributions(6)
    out, _, _ = _verify_step([1] * N, p.log(), p_bonus.log(), q if with_draft_probs else None, seed=1)
    assert one_pass_calls == [1]
    assert _fit(out[:, 0].numpy(), p) > ALPHA
    accepted = out[:, 1] >= 0
    expected = torch.minimum(p, q).sum().item() if with_draft_probs else p.mean().item()
    rate = accepted.double().mean().item()
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / N) ** 0.5, (rate, expected)
    assert _fit(out[accepted, 1].numpy(), p_bonus) > ALPHA
    assert _fit(out[accepted, 1].numpy(), p) < POWER_ALPHA  # power: the draft rows' p is told apart


def test_one_pass_verify_applies_the_temperature(one_pass_calls):
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(V, generator=gen) * 2
    _, q = _distributions(9)
    out, _, _ = _verify_step([1] * N, logits, logits, q, seed=2, temperature=0.7)
    assert one_pass_calls == [1]
    assert _fit(out[:, 0].numpy(), (logits / 0.7).softmax(-1)) > ALPHA
    assert _fit(out[:, 0].numpy(), logits.softmax(-1)) < POWER_ALPHA


def test_one_pass_verify_lossy_recovery_is_caught(one_pass_calls, monkeypatch):
    """Planted: a rejection resampled from the target itself. The fit must fail."""
    p, q = _distributions()
    monkeypatch.setattr(sampling, "residual_weights", lambda target, draft, ids: target.clone())
    out, _, _ = _verify_step([1] * N, p.log(), p.log(), q, seed=3)
    assert _fit(out[:, 0].numpy(), p) < POWER_ALPHA


def test_one_pass_verify_emits_vllms_logprobs_and_ranks(one_pass_calls):
    """A ragged batch (0-3 drafts per request) with the sampled token's logprob asked for: each emitted
    token's logprob is the log-softmax of its own row and its rank counts the entries at or above it,
    computed here from the logits; slots that emit nothing are not read by vLLM (``parse_output``)."""
    counts = [3, 0, 1, 2, 3, 3, 1, 0, 2, 3, 3, 1] * 20
    gen = torch.Generator().manual_seed(11)
    rows = sum(counts) + len(counts)
    target_row = torch.randn(V, generator=gen) * 3
    target = target_row.expand(sum(counts), V)
    bonus = torch.randn(len(counts), V, generator=gen) * 3
    q = (target_row + torch.randn(V, generator=gen) * 0.5).softmax(-1)  # near p: drafts accepted often
    out, lp, logits = _verify_step(counts, target, bonus, q, seed=4, logprobs=0)
    assert one_pass_calls == [1] and logits.shape[0] == rows
    starts = [sum(c + 1 for c in counts[:r]) for r in range(len(counts))]
    reference = logits.log_softmax(-1)
    checked = 0
    for r, n in enumerate(counts):
        for j in range(n + 1):
            slot = r * out.shape[1] + j
            token = int(out[r, j])
            if token < 0:
                continue
            row = reference[starts[r] + j]
            assert int(lp.logprob_token_ids[slot, 0]) == token
            assert float(lp.logprobs[slot, 0]) == pytest.approx(float(row[token]), abs=1e-5)
            assert int(lp.selected_token_ranks[slot]) == int((row >= row[token]).sum())
            checked += 1
    assert checked > 1.5 * len(counts)  # accepted drafts as well as the final token (one per request)


def test_one_pass_verify_seeded_requests_are_reproducible(one_pass_calls):
    p, q = _distributions(12)

    def run(seed_of_first: int) -> torch.Tensor:
        gens = {i: torch.Generator().manual_seed(seed_of_first + i) for i in range(2000)}
        return _verify_step([2] * 2000, p.log(), p.log(), q, seed=5, generators=gens)[0]

    a, b, c = run(0), run(0), run(10 ** 6)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("change", ["greedy", "top_k", "penalties", "top_logprobs", "logprobs_at_t_0_7",
                                    "logit_bias", "min_tokens"])
def test_one_pass_verify_leaves_other_batches_to_vllm(installed, change):
    """What the one pass does not model goes through vLLM's own forward; a plain T=1 batch does not."""
    from types import SimpleNamespace

    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor
    from vllm.v1.sample.sampler import Sampler

    sampler = SimpleNamespace(synthetic_mode=False, sampler=Sampler())
    meta = _metadata(4)
    assert cpu_samplers.one_pass_verify_applies(sampler, meta)
    if change == "greedy":
        meta.all_random, meta.temperature = False, torch.tensor([0.0, 1.0, 1.0, 1.0])
    elif change == "top_k":
        meta.top_k = torch.full((4,), 5)
    elif change == "penalties":
        meta.no_penalties = False
    elif change == "top_logprobs":
        meta.max_num_logprobs = 2
    elif change == "logprobs_at_t_0_7":
        meta.max_num_logprobs, meta.temperature = 0, torch.full((4,), 0.7)
    elif change == "logit_bias":
        proc = LogitBiasLogitsProcessor(None, torch.device("cpu"), False)
        meta.logitsprocs = LogitsProcessors([proc])
        assert cpu_samplers.one_pass_verify_applies(sampler, meta)  # loaded but idle
        proc.biases = {0: {3: 1.0}}
    elif change == "min_tokens":
        proc = object.__new__(MinTokensLogitsProcessor)
        proc.min_toks = {}
        meta.logitsprocs = LogitsProcessors([proc])
        assert cpu_samplers.one_pass_verify_applies(sampler, meta)
        proc.min_toks = {1: (4, [], {2})}
    assert not cpu_samplers.one_pass_verify_applies(sampler, meta)


@pytest.mark.parametrize("batch", ["one_pass", "handed_to_vllm"])
def test_compact_draft_probs_verify_as_their_spread_rows(installed, batch):
    """A reduced-vocabulary drafter's distributions reach the verify compact (``[rows, draft_vocab]``):
    a ragged batch verified with them emits exactly what the same batch emits with them spread over
    the target's vocabulary, with the same draws; also a batch the one pass hands to vLLM's forward
    (top-k here), which gets them spread. Drafts include tokens outside the draft vocabulary (q = 0:
    always rejected) so a wrong column map shows."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    vocab, draft_vocab = 3 * V, V
    drafter, mapped, h = _reduced_vocab_drafter(draft_vocab=draft_vocab, vocab=vocab, seed=3)
    counts = [3, 0, 1, 2, 3, 3, 1, 0, 2, 3] * 40
    rows = sum(counts)
    hidden = (h + torch.randn(rows, h.shape[1], generator=torch.Generator().manual_seed(4))).contiguous()
    drafts, compact = drafter._sample_draft_tokens(hidden, _metadata(rows))
    assert compact.shape == (rows, draft_vocab)
    outside = torch.nonzero(~torch.isin(torch.arange(vocab), mapped)).view(-1)
    drafts[::11] = outside[torch.arange(len(drafts[::11])) % len(outside)]
    gen = torch.Generator().manual_seed(5)
    meta, target_rows, bonus_rows = _verify_metadata(counts, drafts.to(torch.int32))
    logits = torch.empty(meta.logits_indices.shape[0], vocab)
    # The target near the draft's own distribution: most drafts accepted, rejections at every depth.
    logits[target_rows] = cpu_samplers.full_draft_probs(compact, vocab).clamp(min=1e-6).log() \
        + torch.randn(rows, vocab, generator=gen) * 0.3
    logits[bonus_rows] = torch.randn(len(counts), vocab, generator=gen) * 2
    sampling = _metadata(len(counts))
    if batch == "handed_to_vllm":
        from vllm.v1.sample.logits_processor import LogitsProcessors

        sampling.top_k, sampling.logitsprocs = torch.full((len(counts),), vocab), LogitsProcessors([])
    outputs = []
    for probs in (compact, cpu_samplers.full_draft_probs(compact, vocab)):
        torch.manual_seed(6)
        outputs.append(RejectionSampler(Sampler())(meta, probs.clone(), logits.clone(), sampling).sampled_token_ids)
    assert torch.equal(outputs[0], outputs[1])
    emitted = (outputs[0] >= 0).sum(1) - 1  # accepted drafts per request
    assert 0 < emitted.float().mean() < torch.tensor(counts).float().mean()
    for r, c in enumerate(counts):
        start = sum(counts[:r])
        for j in range(int(emitted[r])):
            assert int(drafts[start + j]) in set(mapped.tolist())  # a token q never drafts is never accepted
