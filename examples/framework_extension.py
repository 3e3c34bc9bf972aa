"""Stands for an RL framework's own vLLM worker extension (verl's and OpenRLHF's carry their weight-sync
calls): combined with the package's by ``vllm_specrl.inprocess.extension.combined_extension``. Workers
import it by name, so it lives in a module on their path, as a framework's does in its package."""

from __future__ import annotations


class FrameworkExtension:
    def framework_param_sums(self, names: list[str]) -> dict[str, float]:
        """What a framework reads back from the served model: here, the sums of some parameters."""
        params = dict(self.model_runner.get_model().named_parameters())
        return {name: float(params[name].detach().double().sum()) for name in names if name in params}
