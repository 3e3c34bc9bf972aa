"""``scripts/bench/bench_gpu_step_cost.py`` on the CPU at toy shapes: its decoder layer is a real GQA layer (the
folded-query attention equals torch's own GQA attention with a causal mask over the cache), and its
derived columns follow from the times it measured.

Engines: one run of the benchmark script at toy shapes on the CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts" / "bench"))

import bench_gpu_step_cost as bench  # noqa: E402


def test_the_folded_gqa_layer_equals_torchs_gqa_attention():
    torch.manual_seed(0)

    class Args:
        hidden, intermediate, heads, kv_heads = 64, 128, 8, 2

    s = bench.Shapes(Args)
    p = bench.make_layer(s, s.h, torch.device("cpu"), torch.float32)
    b, q, ctx = 2, 3, 10
    x = torch.randn(b, q, s.h)
    kc, vc = torch.randn(b, s.kvh, ctx + q, s.hd), torch.randn(b, s.kvh, ctx + q, s.hd)
    inv = 1.0 / (10000 ** (torch.arange(0, s.hd, 2).float() / s.hd))
    angles = torch.outer(torch.arange(ctx + q).float(), inv)
    cos, sin = angles.cos()[ctx:], angles.sin()[ctx:]
    allowed = torch.arange(ctx + q)[None, :] <= ctx + torch.arange(q)[:, None]
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf")).repeat(s.nh // s.kvh, 1)
    out = bench.layer_forward(s, p, x, x, kc.clone(), vc.clone(), ctx, cos, sin, mask)

    qkv = bench.rms(x, p["n1"]) @ p["qkv"]
    qh, kh, vh = qkv.split([s.nh * s.hd, s.kvh * s.hd, s.kvh * s.hd], dim=-1)
    qh = bench.rope(qh.view(b, q, s.nh, s.hd).transpose(1, 2), cos, sin)
    k2, v2 = kc.clone(), vc.clone()
    k2[:, :, ctx:] = bench.rope(kh.view(b, q, s.kvh, s.hd).transpose(1, 2), cos, sin)
    v2[:, :, ctx:] = vh.view(b, q, s.kvh, s.hd).transpose(1, 2)
    att = F.scaled_dot_product_attention(qh, k2, v2, attn_mask=allowed, enable_gqa=True)
    ref = x + att.transpose(1, 2).reshape(b, q, -1) @ p["o"]
    gate, up = (bench.rms(ref, p["n2"]) @ p["up"]).chunk(2, dim=-1)
    ref = ref + (F.silu(gate) * up) @ p["down"]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_toy_run_reports_costs_that_follow_from_its_times(tmp_path):
    out = tmp_path / "cost.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "bench_gpu_step_cost.py"), "--device", "cpu",
                    "--no-graphs",
                    "--layers", "2", "--hidden", "128", "--intermediate", "256", "--heads", "4", "--kv-heads", "2",
                    "--vocab", "2048", "--draft-vocab", "512", "--batch-sizes", "1,2", "--context", "32",
                    "--reps", "2", "--out", str(out)], check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        t = {int(q): ms for q, ms in r["target_ms"].items()}
        assert sorted(t) == [1, 2, 3, 4] and r["draft_pass_ms"] > 0
        cost = r["spec_step_vs_plain"]["3"]
        assert abs(cost - (t[4] + 3 * r["draft_pass_ms"]) / t[1]) < 1e-9
        assert abs(r["throughput_vs_plain"]["0.6"]["3"] - (1 + 0.6 + 0.36 + 0.216) / cost) < 1e-9
