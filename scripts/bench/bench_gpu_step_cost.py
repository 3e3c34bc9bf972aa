"""What a speculative step costs at 8B shapes on a GPU, measured with torch alone.

vLLM does not run on the GPU machines this project is sometimes lent, so this measures the parts of a
decode step that decide speculation's economics there: the target's forward over 1 token per
sequence (a plain step) against k + 1 tokens (verifying k drafts), and one EAGLE-3 draft pass (fc over
3 aux layers, one decoder layer with a 2H-wide input, LM head over the draft vocabulary), each with
sampling over its vocabulary, at batch sizes from 1 to RL's hundreds. Llama-3-8B shapes (hidden
4096, 32 layers, GQA 32/8 heads, MLP 14336, vocabulary 128256), bf16, random weights, a KV cache
of ``--context`` tokens per sequence; every step is captured in a CUDA graph and replayed (as vLLM
serves decode), timed with CUDA events, median of ``--reps``. Not measured: vLLM's scheduler and
input preparation, its rejection-sampler kernel (a sampling pass over the k + 1 rows stands in),
real acceptance at 8B. A speculative step's cost in plain steps is
``(target(k + 1) + k * draft) / target(1)``; the JSON also lists the throughput against plain that
gives at a few per-position acceptance rates (``derived``).

    python scripts/bench/bench_gpu_step_cost.py --out $OUT/gpu_step_cost.json
    python scripts/bench/bench_gpu_step_cost.py --device cpu --no-graphs --layers 2 --hidden 256 \\
        --intermediate 512 --heads 4 --kv-heads 2 --vocab 4096 --draft-vocab 1024 --batch-sizes 1,4   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * w


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class Shapes:
    def __init__(self, a: argparse.Namespace):
        self.h, self.i, self.nh, self.kvh = a.hidden, a.intermediate, a.heads, a.kv_heads
        self.hd = a.hidden // a.heads


def make_layer(s: Shapes, in_width: int, device, dtype) -> dict[str, torch.Tensor]:
    def w(*shape):
        return torch.randn(*shape, device=device, dtype=dtype) * shape[0] ** -0.5
    return {"qkv": w(in_width, (s.nh + 2 * s.kvh) * s.hd), "o": w(s.nh * s.hd, s.h), "up": w(s.h, 2 * s.i),
            "down": w(s.i, s.h), "n1": torch.ones(in_width, device=device, dtype=dtype),
            "n2": torch.ones(s.h, device=device, dtype=dtype)}


def layer_forward(s: Shapes, p: dict, x: torch.Tensor, residual: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                  ctx: int, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One decoder layer over q new tokens at positions ctx .. ctx + q - 1 (KV written into the cache)."""
    b, q, _ = x.shape
    qkv = rms(x, p["n1"]) @ p["qkv"]
    qh, kh, vh = qkv.split([s.nh * s.hd, s.kvh * s.hd, s.kvh * s.hd], dim=-1)
    qh = rope(qh.view(b, q, s.nh, s.hd).transpose(1, 2), cos, sin)
    kh = rope(kh.view(b, q, s.kvh, s.hd).transpose(1, 2), cos, sin)
    kc[:, :, ctx:ctx + q] = kh
    vc[:, :, ctx:ctx + q] = vh.view(b, q, s.kvh, s.hd).transpose(1, 2)
    # GQA with the query heads of a KV head folded into the query length: no KV copies, and a fused
    # attention kernel also where a mask is needed (q > 1), as serving kernels do.
    group = s.nh // s.kvh
    qh = qh.reshape(b, s.kvh, group * q, s.hd)
    att = F.scaled_dot_product_attention(qh, kc[:, :, :ctx + q], vc[:, :, :ctx + q], attn_mask=mask)
    att = att.view(b, s.kvh, group, q, s.hd).reshape(b, s.nh, q, s.hd)
    x = residual + att.transpose(1, 2).reshape(b, q, s.nh * s.hd) @ p["o"]
    gate, up = (rms(x, p["n2"]) @ p["up"]).chunk(2, dim=-1)
    return x + (F.silu(gate) * up) @ p["down"]


def sample(logits: torch.Tensor) -> torch.Tensor:
    """T = 1 sampling over the full row (Gumbel-max on float32 log-probabilities)."""
    logp = logits.float().log_softmax(-1)
    return (logp - torch.rand_like(logp).log_().neg_().log_()).argmax(-1)


def timed(fn, graphs: bool, reps: int, device) -> float:
    """Median ms of ``fn`` (captured in a CUDA graph and replayed where ``graphs``)."""
    if graphs:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    else:
        run = fn
    for _ in range(3):
        run()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def derived(row: dict, ks: list[int], rates: list[float]) -> dict:
    """A speculative step in plain steps, and tokens per plain step's time for a per-position acceptance
    rate r (each draft accepted with probability r given the earlier ones: 1 + r + ... + r^k tokens)."""
    target = {int(q): ms for q, ms in row["target_ms"].items()}
    cost = {k: (target[k + 1] + k * row["draft_pass_ms"]) / target[1] for k in ks}
    return {"spec_step_vs_plain": cost, "verify_vs_plain": {k: target[k + 1] / target[1] for k in ks},
            "throughput_vs_plain": {str(r): {k: sum(r ** j for j in range(k + 1)) / cost[k] for k in ks}
                                    for r in rates}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch-sizes", default="1,16,64,256")
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--acceptance-rates", default="0.4,0.6,0.8",
                    help="per-position acceptance rates the throughput column is computed for (0.4: this "
                         "project's SmolLM2 demo draft at T=1; EAGLE-3 at 8B is reported around 0.6-0.8)")
    ap.add_argument("--out", type=Path, default=Path("results/gpu_step_cost.json"))
    a = ap.parse_args()
    device, dtype = torch.device(a.device), torch.bfloat16
    graphs = a.graphs and device.type == "cuda"
    torch.manual_seed(0)
    s = Shapes(a)
    ks = [int(k) for k in a.ks.split(",")]
    max_q = max(ks) + 1
    target = [make_layer(s, s.h, device, dtype) for _ in range(a.layers)]
    embed = torch.randn(a.vocab, s.h, device=device, dtype=dtype)
    head = torch.randn(s.h, a.vocab, device=device, dtype=dtype) * s.h ** -0.5
    final_norm = torch.ones(s.h, device=device, dtype=dtype)
    draft_layer = make_layer(s, 2 * s.h, device, dtype)
    fc = torch.randn(3 * s.h, s.h, device=device, dtype=dtype) * (3 * s.h) ** -0.5
    draft_head = torch.randn(s.h, a.draft_vocab, device=device, dtype=dtype) * s.h ** -0.5
    inv = 1.0 / (10000 ** (torch.arange(0, s.hd, 2, device=device).float() / s.hd))
    angles = torch.outer(torch.arange(a.context + max_q, device=device).float(), inv)
    cos_all, sin_all = angles.cos().to(dtype), angles.sin().to(dtype)
    rows = []
    for batch in [int(b) for b in a.batch_sizes.split(",")]:
        cache = [(torch.randn(batch, s.kvh, a.context + max_q, s.hd, device=device, dtype=dtype),
                  torch.randn(batch, s.kvh, a.context + max_q, s.hd, device=device, dtype=dtype))
                 for _ in range(a.layers + 1)]  # the last one is the draft layer's
        row = {"batch": batch, "target_ms": {}, "target_forward_ms": {}}
        for q in [1] + [k + 1 for k in ks]:
            ids = torch.randint(0, a.vocab, (batch, q), device=device)
            cos, sin = cos_all[a.context:a.context + q], sin_all[a.context:a.context + q]
            keys = torch.arange(a.context + q, device=device)
            allowed = keys[None, :] <= a.context + torch.arange(q, device=device)[:, None]  # [q, context + q]
            mask = None if q == 1 else torch.zeros(allowed.shape, device=device, dtype=dtype).masked_fill_(
                ~allowed, float("-inf")).repeat(s.nh // s.kvh, 1)  # rows: group-major, as the folded queries

            def forward(ids=ids, cos=cos, sin=sin, mask=mask):
                x = embed[ids]
                for p, (kc, vc) in zip(target, cache):
                    x = layer_forward(s, p, x, x, kc, vc, a.context, cos, sin, mask)
                return rms(x, final_norm) @ head

            row["target_forward_ms"][q] = timed(forward, graphs, a.reps, device)
            row["target_ms"][q] = timed(lambda forward=forward: sample(forward().view(-1, a.vocab)),
                                        graphs, a.reps, device)
        token = torch.randint(0, a.vocab, (batch, 1), device=device)
        aux = torch.randn(batch, 1, 3 * s.h, device=device, dtype=dtype)
        kc, vc = cache[-1]

        def draft_pass():
            hidden = aux @ fc
            x = torch.cat([embed[token], hidden], dim=-1)
            x = layer_forward(s, draft_layer, x, hidden, kc, vc, a.context, cos_all[a.context:a.context + 1],
                              sin_all[a.context:a.context + 1], None)
            return sample((rms(x, final_norm) @ draft_head).view(-1, a.draft_vocab))

        row["draft_pass_ms"] = timed(draft_pass, graphs, a.reps, device)
        plain = row["target_ms"][1]
        row.update(derived(row, ks, [float(r) for r in a.acceptance_rates.split(",")]))
        rows.append(row)
        print(json.dumps({"batch": batch, "plain_ms": round(plain, 3), "draft_pass_ms": round(row["draft_pass_ms"], 3),
                          "verify_vs_plain": {k: round(v, 3) for k, v in row["verify_vs_plain"].items()},
                          "spec_step_vs_plain": {k: round(v, 3) for k, v in row["spec_step_vs_plain"].items()}}),
              flush=True)
        cache.clear()  # the next batch size allocates its own
        if device.type == "cuda":
            torch.cuda.empty_cache()
    info = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "cuda_graphs": graphs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"benchmark": "gpu_step_cost", "host": info, "settings": vars(a) | {"out": str(a.out)},
                                 "rows": rows}, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
