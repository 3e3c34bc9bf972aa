"""The benchmark harness runs end to end and reports ratios against plain vLLM."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_rollout_offline_smoke(tiny_model, tmp_path):
    out = tmp_path / "bench.json"
    spec = '{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_max":3}'
    subprocess.run([sys.executable, str(REPO / "scripts" / "bench_rollout.py"),
                    "--model", str(tiny_model), "--modes", "offline", "--batch-sizes", "2",
                    "--prompts", "2", "--samples", "2", "--max-tokens", "16", "--temperature", "0",
                    "--dtype", "float32", "--max-model-len", "512",
                    "--speculative-config", spec, "--out", str(out)], check=True, timeout=600)
    report = json.loads(out.read_text())
    plain, ngram = report["cells"]
    assert "error" not in plain and "error" not in ngram, report
    assert plain["name"] == "plain" and plain["tokens"] == 2 * 2 * 16
    assert ngram["tokens"] == plain["tokens"]
    assert ngram["throughput_ratio_vs_plain"] > 0
    assert ngram["spec_decode"]["num_drafts"] > 0
