"""vllm-specrl: lossless speculative rollouts for RL, as a fork-free vLLM extension.

Importing the package is cheap: it does not import vLLM or torch. The vLLM
side is wired by entry points (``vllm_specrl.plugin:register`` and
``vllm_specrl.endpoints:endpoint_plugin``); see the README. The trainer side is
``vllm_specrl.EngineClient`` (imported on first use).
"""

from typing import Any

from vllm_specrl import _moved
from vllm_specrl._version import __version__

_moved.install()  # modules of an earlier layout stay importable by their old names

__all__ = ["EngineClient", "WeightSyncError", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("EngineClient", "WeightSyncError"):
        from vllm_specrl.sync.clients import engine_client

        return getattr(engine_client, name)
    raise AttributeError(name)
