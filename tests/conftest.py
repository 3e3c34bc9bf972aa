"""Shared test setup: fixture models (built once, cached) and CPU engine defaults."""

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURE_ROOT = Path(os.environ.get("VLLM_SPECRL_FIXTURES", REPO / ".fixtures")).resolve()
# The benchmarks' shared modules (engine processes, the speed-up projection) live beside them in
# scripts/bench, not in the package: their tests import them from there.
sys.path.insert(0, str(REPO / "scripts" / "bench"))

# Without a KV-cache size vLLM reserves a share of RAM and fails.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# TRL (imported when tests/integrations/test_trl.py is collected) sets VLLM_LOGGING_LEVEL=ERROR in this
# process unless it is already set, and every `vllm serve` started later would inherit it: tests read
# vLLM's INFO lines (the plugin's "active in ... process" lines), so pin vLLM's default here.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
# Engines started by the tests fork their engine core and worker instead of spawning them (each
# spawn re-imports vLLM, ~14 s here): a `vllm serve` is ready in ~20 s instead of ~47
# (cpu_start_method.install_cpu_start_method; tests/compat/test_cpu_start_method.py runs both ways).
os.environ.setdefault("VLLM_SPECRL_CPU_START_METHOD", "fork")


@pytest.fixture(scope="session", autouse=True)
def servers_from_the_server_zygote():
    """Every ``vllm serve`` a test starts through ``VLLMServer`` is forked from one pre-imported
    interpreter (tests/zygote.py, ``--servers``): ready in ~5 s instead of ~20 on 2 cores.
    ``SPECRL_TEST_ZYGOTE=0``: started as a user starts them."""
    from helpers import STOCK_START_PROCESS, start_from_the_server_zygote
    from vllm_specrl.launcher import VLLMServer

    VLLMServer._start_process = start_from_the_server_zygote
    yield
    VLLMServer._start_process = STOCK_START_PROCESS


@pytest.fixture(scope="session")
def fixture_root() -> Path:
    from vllm_specrl.fixtures import build_fixtures

    build_fixtures(FIXTURE_ROOT, ("tiny", "tiny-qwen2", "tiny-mimo"))
    return FIXTURE_ROOT


@pytest.fixture(scope="session")
def tiny_model(fixture_root) -> Path:
    from vllm_specrl.fixtures import fixture_target

    return fixture_target("tiny", fixture_root)


@pytest.fixture(scope="session")
def real_model(fixture_root) -> Path:
    from vllm_specrl.fixtures import build_fixtures, fixture_target

    build_fixtures(fixture_root, ("real",))
    return fixture_target("real", fixture_root)


@pytest.fixture(scope="session")
def qwen2_model(fixture_root) -> Path:
    from vllm_specrl.fixtures import fixture_target

    return fixture_target("tiny-qwen2", fixture_root)


@pytest.fixture(scope="session")
def mimo_model(fixture_root) -> Path:
    """tiny-qwen2's body with a trained MiMo-style MTP layer (``"method": "mtp"``)."""
    from vllm_specrl.fixtures import fixture_target

    return fixture_target("tiny-mimo", fixture_root)


WARM_DRAFT_VOCAB = 1024


def train_draft(argv: list[str]) -> None:
    """``vllm-specrl train-draft --offline ARGV`` as the CLI runs it, in a child of the suite's zygote
    (vLLM imported once for the session rather than once per draft)."""
    from helpers import run_python

    run_python(f"""
        from vllm_specrl import cli
        raise SystemExit(cli.main(["train-draft", "--offline", *{argv!r}]))
    """, env={"VLLM_PLUGINS": "specrl"}, timeout=1200)


@pytest.fixture(scope="session")
def warm_draft(tiny_model, tmp_path_factory) -> Path:
    """An EAGLE-3 draft warm-started on the tiny target's own rollouts through the CLI.

    Reduced draft vocabulary (1024 of 4096) so the d2t/t2d path is served too.
    Built once per session (~2 min); the summary is saved beside the draft.
    """
    from prompts import code_prompts

    work = tmp_path_factory.mktemp("warm")
    out = work / "draft"
    # In-domain prompts for the code-trained target, disjoint from the tests' first 200.
    prompt_file = work / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in code_prompts(264)[200:]))
    train_draft(["--target", str(tiny_model), "--draft", str(out), "--raw-prompts",
                 "--prompts", str(prompt_file), "--samples", "4", "--max-tokens", "48", "--steps", "80",
                 "--batch-size", "16", "--lr", "3e-3", "--draft-vocab-size", str(WARM_DRAFT_VOCAB),
                 # The HF feature path: the drafts other tests use stay as they were; the capture path
                 # (the CLI default) is checked against it in tests/trainer/test_captured.py.
                 "--features", "hf"])
    return out


@pytest.fixture(scope="session")
def parallel_draft(tiny_model, warm_draft, tmp_path_factory) -> Path:
    """The warm draft converted to a parallel (P-EAGLE) draft and trained 40 steps on the warm
    draft's own saved rollouts, through the CLI (``--init-from --parallel-drafting``; ~40 s)."""
    work = tmp_path_factory.mktemp("parallel")
    out = work / "draft"
    train_draft(["--target", str(tiny_model), "--draft", str(out), "--init-from", str(warm_draft),
                 "--parallel-drafting", "--rollouts", str(warm_draft / "warm_start_rollouts.json"), "--steps", "40",
                 "--batch-size", "16", "--lr", "3e-3", "--features", "hf"])
    return out


PARALLEL_MAX_TOKENS = 16


@pytest.fixture(scope="session")
def moved_policy(tiny_model, tmp_path_factory) -> Path:
    """The tiny target after an exaggerated RL step: the policy update the parallel-engine tests push."""
    from helpers import perturbed_checkpoint

    return perturbed_checkpoint(tiny_model, tmp_path_factory.mktemp("moved_policy") / "v1", seed=1)


@pytest.fixture(scope="session")
def parallel_prompts() -> list[str]:
    """The prompts the tensor- and data-parallel tests serve."""
    from prompts import code_prompts

    return code_prompts(8)


@pytest.fixture(scope="session")
def single_engine_greedy(tiny_model, moved_policy, parallel_prompts) -> dict[str, list[str]]:
    """What one in-process engine answers greedily to ``parallel_prompts`` (``PARALLEL_MAX_TOKENS``) with
    the tiny target and with the moved policy: what tensor- and data-parallel engines must reproduce
    (computed once for both)."""
    from sampling import greedy_generate

    return {name: greedy_generate(model, parallel_prompts, PARALLEL_MAX_TOKENS, with_text=True)["texts"]
            for name, model in (("original", tiny_model), ("moved", moved_policy))}
