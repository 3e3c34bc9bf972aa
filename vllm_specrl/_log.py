"""One logger for the package, parented under vLLM's so lines share its format."""

import logging

logger = logging.getLogger("vllm.vllm_specrl")
