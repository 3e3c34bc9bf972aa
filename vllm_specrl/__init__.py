"""vllm-specrl: lossless speculative rollouts for RL, as a fork-free vLLM extension.

Importing the package is cheap: it does not import vLLM or torch. The vLLM
side is wired by entry points (``vllm_specrl.plugin:register`` and
``vllm_specrl.http:endpoint_plugin``); see the README.
"""

from vllm_specrl._version import __version__

__all__ = ["__version__"]
