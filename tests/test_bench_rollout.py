"""The benchmark harness sweeps every method end to end and reports ratios against plain vLLM."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_rollout_sweep_on_tiny(tiny_model, warm_draft, tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "bench_rollout.py"),
                    "--model", str(tiny_model), "--warm-draft", str(warm_draft),
                    "--methods", "plain,ngram,eagle3-random,eagle3-warm", "--ks", "2",
                    "--temperatures", "0,1", "--batch-sizes", "2", "--waves", "1",
                    "--prompts", "2", "--samples", "2", "--max-tokens", "16",
                    "--dtype", "float32", "--max-model-len", "512", "--out", str(out)],
                   check=True, timeout=900)
    report = json.loads(out.read_text())
    cells = report["cells"]
    assert not [c for c in cells if "error" in c], cells
    assert {(c["method"], c["temperature"]) for c in cells} == {
        (m, t) for m in ("plain", "ngram", "eagle3-random", "eagle3-warm") for t in (0.0, 1.0)}
    for c in cells:
        assert c["tokens"] == 2 * 16 and c["batch_size"] == 2
        if c["method"] != "plain":
            assert c["k"] == 2 and c["spec_decode"]["num_drafts"] > 0
            assert c["throughput_ratio_vs_plain"] > 0
            assert c["step_cost_vs_plain"] > 0
    # The random draft is built with the warm draft's reduced vocabulary (same cost).
    random_cfg = json.loads((Path(report["drafts"]["eagle3-random"]) / "config.json").read_text())
    assert random_cfg["draft_vocab_size"] == 1024
    assert Path(report["plot"]).stat().st_size > 10_000
