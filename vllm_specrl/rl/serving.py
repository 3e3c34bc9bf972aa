"""The ``vllm serve`` arguments for a rollout engine with each proposer, and the rules that pick them.

``serve_args("eagle3", draft=DIR, capture=ADDRESS)`` gives what to pass after the model; ``command``
the whole command line. The rules a user would otherwise learn the hard way: EAGLE-3 and MTP drafts
are sampled (``probabilistic``: what the rejection sampler needs at T = 1) and served with adaptive k;
the history proposer is served without it (its per-request draft lengths give adaptive k no steady
steps to measure a k's cost on); only a proposer with a draft to train captures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_specrl.launcher import WORKER_EXTENSION
from vllm_specrl.switches import ADAPTIVE_K_SCHEDULER, HISTORY_PROPOSER

PROPOSERS = ("eagle3", "mtp", "history", "plain")


@dataclass(frozen=True)
class ServeArgs:
    """What ``serve_args`` decided: the arguments after the model, and what they amount to."""

    args: list[str]
    speculative_config: dict[str, Any] | None
    capture: str | None       # the address the engine streams captured rows to (None: no capture)
    drafter: str | None       # what an online trainer trains on that capture: "eagle3", "mtp" or None
    adaptive_k: bool

    def command(self, model: str | Path, api_key: str | None = None) -> list[str]:
        """The whole ``vllm serve`` command (run it with ``VLLM_PLUGINS=specrl,specrl_http``)."""
        key = ["--api-key", api_key] if api_key else []
        return ["vllm", "serve", str(model), "--worker-extension-cls", WORKER_EXTENSION, *key, *self.args]


def serve_args(proposer: str, *, k: int = 3, draft: str | Path | None = None, adaptive_k: bool = True,
               capture: str | None = None, capture_topk: int = 64, dtype: str | None = None,
               max_model_len: int | None = None, seed: int | None = None,
               additional: dict[str, Any] | None = None) -> ServeArgs:
    """Arguments for serving rollouts with ``proposer`` (``eagle3`` needs ``draft``; ``mtp`` a model with
    MTP layers). ``capture``: a ZMQ address for the online draft trainer (EAGLE-3 and MTP only).
    ``additional``: more ``specrl`` keys for ``--additional-config``."""
    if proposer not in PROPOSERS:
        raise ValueError(f"proposer must be one of {PROPOSERS}, not {proposer!r}")
    if proposer == "eagle3" and draft is None:
        raise ValueError("an EAGLE-3 engine needs a draft directory (vllm-specrl init-draft makes one)")
    if capture and proposer not in ("eagle3", "mtp"):
        raise ValueError(f"capture feeds an online draft trainer; the {proposer} proposer has no draft to train")
    spec: dict[str, Any] | None = None
    config = dict(additional or {})
    if proposer == "eagle3":
        spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": k,
                "draft_sample_method": "probabilistic"}
        if capture:
            config.update(capture=capture, capture_topk=capture_topk)
    elif proposer == "mtp":
        spec = {"method": "mtp", "num_speculative_tokens": k, "draft_sample_method": "probabilistic"}
        if capture:
            config.update(capture=capture)
    elif proposer == "history":
        spec = {"method": "custom_class", "model": HISTORY_PROPOSER, "num_speculative_tokens": k}
    adaptive = adaptive_k and proposer in ("eagle3", "mtp")
    args = [*(["--dtype", dtype] if dtype else []), *(["--max-model-len", str(max_model_len)] if max_model_len else []),
            *(["--seed", str(seed)] if seed is not None else [])]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    if adaptive:
        args += ["--scheduler-cls", ADAPTIVE_K_SCHEDULER]
    if config:
        args += ["--additional-config", json.dumps({"specrl": config})]
    return ServeArgs(args, spec, capture if proposer in ("eagle3", "mtp") else None,
                     proposer if capture else None, adaptive)
