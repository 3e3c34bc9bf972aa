import pytest
import torch
from torch.nn import functional as F

from vllm_specrl.proposer.eagle3_config import draft_config_from_target
from vllm_specrl.proposer.eagle3_torch import Eagle3Draft, apply_rope, rope_cos_sin

TARGET = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 50, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


def make_draft(vocab=None) -> Eagle3Draft:
    torch.manual_seed(0)
    d = Eagle3Draft(draft_config_from_target(TARGET, vocab))
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return d


def inputs(b=2, t=10):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, t, 3 * 32, generator=g), torch.randint(0, 50, (b, t), generator=g)


def test_unroll_shapes_and_reduced_vocab():
    d = make_draft(vocab=20)
    d.set_draft_vocab(torch.arange(0, 40, 2))
    assert d.draft_token_ids().tolist() == list(range(0, 40, 2))
    assert d.t2d.sum() == 20 and d.t2d[38] and not d.t2d[39]
    aux, tok = inputs()
    outs = d.unroll(aux, tok, steps=3)
    assert len(outs) == 3 and all(o.shape == (2, 10, 20) for o in outs)


def test_step0_is_causal_attention_over_the_sequence():
    """Step 0 equals a reference causal layer built from torch's SDPA."""
    d = make_draft()
    aux, tok = inputs()
    got = d.unroll(aux, tok, steps=1)[0]
    shifted = torch.cat([tok[:, 1:], torch.zeros_like(tok[:, :1])], dim=1)
    want = causal_reference(d, shifted, d.fc(aux), torch.arange(tok.shape[1]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_ttt_steps_never_see_the_future():
    """Step k at base t may read aux <= t and tokens <= t+1+k, nothing later."""
    d = make_draft()
    aux, tok = inputs(b=1, t=12)
    base = d.unroll(aux, tok, steps=3)
    t = 5
    aux2, tok2 = aux.clone(), tok.clone()
    aux2[:, t + 1 :] += 3.0
    for k in range(3):
        tok3 = tok2.clone()
        tok3[:, t + 2 + k :] = (tok3[:, t + 2 + k :] + 7) % 50
        changed = d.unroll(aux2, tok3, steps=3)
        torch.testing.assert_close(changed[k][:, : t + 1], base[k][:, : t + 1])
    # ...and it does read the token at t+1+k.
    tok4 = tok.clone()
    tok4[:, t + 1 + 2] = (tok4[:, t + 1 + 2] + 1) % 50
    assert not torch.allclose(d.unroll(aux, tok4, steps=3)[2][:, t], base[2][:, t])


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
def test_masked_unroll_equals_the_dense_one_where_a_loss_reads(parallel):
    """The row-sparse unroll (only rows some step's loss reads go past the attention scores)
    gives the dense unroll's logits and gradients at every masked position, also for masks
    that do not nest (a row only step 2 reads still needs steps 0 and 1, sequentially); a
    parallel draft's gradients reach its mask state."""
    d = make_parallel_draft() if parallel else make_draft()
    aux, tok = inputs(b=3, t=14)
    g = torch.Generator().manual_seed(2)
    masks = [torch.rand(3, 14, generator=g) < p for p in (0.5, 0.3, 0.4)]
    dense = d.unroll(aux, tok, steps=3)
    sparse = d.unroll(aux, tok, steps=3, logits_masks=masks)
    for k, m in enumerate(masks):
        torch.testing.assert_close(sparse[k][m], dense[k][m], rtol=1e-5, atol=1e-5)
        assert not sparse[k][~m].any()

    def grads(outs):
        d.zero_grad()
        sum((o[m] ** 2).mean() * (k + 1) for k, (o, m) in enumerate(zip(outs, masks))).backward()
        return {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}

    want = grads(d.unroll(aux, tok, steps=3))
    got = grads(d.unroll(aux, tok, steps=3, logits_masks=masks))
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    if parallel:
        assert got["mask_hidden"].abs().sum() > 0


def causal_reference(d: Eagle3Draft, token_ids: torch.Tensor, hidden: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """Logits of one causal pass of the draft layer over explicit rows (what one vLLM forward
    computes), with torch's SDPA."""
    layer, s = d.midlayer, d.shape
    x = torch.cat([layer.input_layernorm(d.embed_tokens(token_ids)), layer.hidden_norm(hidden)], -1)
    b, t, _ = x.shape
    cos, sin = rope_cos_sin(positions, s.head_dim, s.rope_theta)
    attn = layer.self_attn
    q = apply_rope(attn.q_proj(x).view(b, t, 4, 8).transpose(1, 2), cos, sin)
    k = apply_rope(attn.k_proj(x).view(b, t, 2, 8).transpose(1, 2), cos, sin)
    v = attn.v_proj(x).view(b, t, 2, 8).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    r = attn.o_proj(o.transpose(1, 2).reshape(b, t, -1)) + hidden
    return d.lm_head(d.norm(layer.mlp(layer.post_attention_layernorm(r)) + r))


def make_parallel_draft(mask_token_id: int = 7) -> Eagle3Draft:
    d = make_draft()
    d.make_parallel(mask_token_id)
    with torch.no_grad():
        d.mask_hidden.normal_(std=1.0, generator=torch.Generator().manual_seed(3))
    return d


def test_a_parallel_draft_equals_one_causal_pass_over_mask_slots():
    """Parallel drafting (P-EAGLE) as vLLM serves it: after the committed rows 0..t, k mask slots
    at positions t+1..t+k reading the mask token and fc(mask_hidden), in one causal pass. Step k
    of the unroll at base t is that pass's row t+k; step 0 is the sequential draft's step 0."""
    d = make_parallel_draft()
    assert d.config["mask_token_id"] == 7 and d.parallel
    aux, tok = inputs(b=2, t=12)
    steps = 3
    got = d.unroll(aux, tok, steps=steps)
    sequential = make_draft().unroll(aux, tok, steps=steps)
    torch.testing.assert_close(got[0], sequential[0])
    g = d.fc(aux)
    mask_state = d.fc(d.mask_hidden)
    for t in (0, 4, 8):
        rows = torch.cat([tok[:, 1 : t + 2], torch.full((2, steps - 1), 7)], 1)
        hidden = torch.cat([g[:, : t + 1], mask_state.expand(2, steps - 1, -1)], 1)
        ref = causal_reference(d, rows, hidden, torch.arange(t + steps))
        for k in range(steps):
            torch.testing.assert_close(got[k][:, t], ref[:, t + k], rtol=1e-4, atol=1e-4)
    # A parallel step does not read the chain's tokens (the sequential one does).
    tok2 = tok.clone()
    tok2[:, 6:] = (tok2[:, 6:] + 5) % 50
    torch.testing.assert_close(d.unroll(aux, tok2, steps=steps)[2][:, 4], got[2][:, 4])
    assert not torch.allclose(make_draft().unroll(aux, tok2, steps=steps)[2][:, 4], sequential[2][:, 4])


def test_a_saved_parallel_draft_loads_with_its_mask(tmp_path):
    import json

    from safetensors import safe_open

    from vllm_specrl.proposer.checkpoint import save_draft

    d = make_parallel_draft()
    save_draft(d, tmp_path / "p")
    cfg = json.loads((tmp_path / "p" / "config.json").read_text())
    assert cfg["mask_token_id"] == 7
    with safe_open(tmp_path / "p" / "model.safetensors", "pt") as fh:
        state = {name: fh.get_tensor(name) for name in fh.keys()}
    assert state["mask_hidden"].shape == (3 * 32,)   # vLLM's layout: one fc input row
    back = Eagle3Draft(cfg)
    missing, unexpected = back.load_state_dict(dict(state, **{"embed_tokens.weight": d.embed_tokens.weight}),
                                               strict=False)
    assert not missing and not unexpected and back.parallel and back.mask_token_id == 7
    torch.testing.assert_close(back.mask_hidden, d.mask_hidden)
