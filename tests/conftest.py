"""Shared test setup: fixture models (built once, cached) and CPU engine defaults."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURE_ROOT = Path(os.environ.get("VLLM_SPECRL_FIXTURES", REPO / ".fixtures")).resolve()

# DESIGN.md section 5: without a KV-cache size vLLM reserves a share of RAM and fails.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def fixture_root() -> Path:
    from vllm_specrl.fixtures import build_fixtures

    build_fixtures(FIXTURE_ROOT, ("tiny", "tiny-qwen2"))
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
