"""One logger for the package, parented under vLLM's so lines share its format."""

import logging
import os
import sys

logger = logging.getLogger("vllm.vllm_specrl")


def log_early(level: int, msg: str, *args: object) -> None:
    """Log even before vLLM has configured logging.

    The general plugin first runs while ``vllm serve`` parses its arguments,
    before vLLM installs its log handler (0.32 configures logging from the
    parsed args), so a plain ``logger.info`` there is silently dropped.
    """
    if logging.getLogger("vllm").handlers:
        logger.log(level, msg, *args)
    else:
        text = msg % args if args else msg
        print(f"({os.getpid()}) {logging.getLevelName(level)} [vllm_specrl] {text}",
              file=sys.stderr, flush=True)
