"""``python -m vllm_specrl.cli``: the ``vllm-specrl`` command."""

from vllm_specrl.cli import main

raise SystemExit(main())
