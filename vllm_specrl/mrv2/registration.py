"""Registering the package's speculative methods with vLLM 0.34 (``register_speculative_method``), from the
general plugin so that every process vLLM starts knows them. Qualified names, so that registering imports
neither vLLM's config package nor our speculators."""

from __future__ import annotations

_CONFIGS = "vllm_specrl.mrv2.configs"

METHODS: dict[str, str] = {
    "specrl_eagle3": f"{_CONFIGS}.SpecRLEagle3Config",
    "specrl_mtp": f"{_CONFIGS}.SpecRLMTPConfig",
    "specrl_history": f"{_CONFIGS}.HistorySpeculatorConfig",
}
# The method a user of vLLM 0.32 / 0.33 names for the same thing (the port map's rows).
REPLACES = {"specrl_eagle3": "eagle3 (capture through the runner tap)", "specrl_mtp": "mtp (capture through the "
            "runner tap)", "specrl_history": "custom_class with vllm_specrl.proposer.history.HistoryProposer"}


def has_speculator_registry() -> bool:
    """Whether the running vLLM takes custom speculators (Model Runner V2's registry, vLLM >= 0.34)."""
    try:
        from vllm.v1.worker.gpu.spec_decode import speculator_config
    except ImportError:
        return False
    return hasattr(speculator_config, "register_speculative_method")


def register_speculative_methods() -> str:
    """Register every method; on a vLLM without the registry, say so (the runner patches serve there)."""
    if not has_speculator_registry():
        return "not needed (this vLLM has no speculator registry: the V1 runner's patches serve)"
    from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method

    for name, config in METHODS.items():
        register_speculative_method(name, config)
    return f"registered {', '.join(METHODS)}"
