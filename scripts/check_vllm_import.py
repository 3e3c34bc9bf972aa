"""Inside an environment with a vLLM that has Model Runner V2's speculator registry (vLLM >= 0.34; made by
``scripts/check_vllm_import.sh``): the plugin registers the package's speculative methods, and vLLM's own
``SpeculativeConfig`` resolves each for a checkpoint to the package's config and speculator classes.

Import-only: vLLM's Python with a CPU torch and no compiled kernels, so nothing here runs an engine. What it
proves is what a GPU user's start-up does before the first forward: plugin loading, method registration,
config resolution, the speculator classes' import and their interface against vLLM's base classes.

    python scripts/check_vllm_import.py --fixtures .fixtures      # exits 1 on the first check that fails
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
from types import SimpleNamespace
from pathlib import Path


def check(what: str, ok: bool, detail: object = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {what}{': ' + str(detail) if detail != '' else ''}", flush=True)
    if not ok:
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, required=True, help="the fixtures root (tiny and tiny-mimo targets)")
    ap.add_argument("--out", type=Path, default=None, help="write what was checked here (JSON)")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_PLUGINS", "specrl")

    import vllm
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm_specrl import plugin
    from vllm_specrl.mrv2.registration import METHODS

    state = plugin.state()
    check(f"plugin active on vLLM {vllm.__version__}", state.get("status") == "active", state.get("reason", ""))
    check("plugin serves Model Runner V2", state.get("model_runner") == "mrv2", state.get("model_runner"))
    from vllm.v1.worker.gpu.spec_decode.speculator_config import registered_speculative_methods

    check("methods registered", set(METHODS) <= set(registered_speculative_methods()), registered_speculative_methods())

    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
    from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator
    from vllm_specrl.proposer.checkpoint import init_draft

    tiny = str(args.fixtures / "tiny" / "target")
    draft = tempfile.mkdtemp(prefix="specrl-draft-")
    init_draft(tiny, draft)
    target = ModelConfig(model=tiny, dtype="float32")
    mimo = ModelConfig(model=str(args.fixtures / "tiny-mimo" / "target"), dtype="float32", trust_remote_code=True)
    cases = {"specrl_eagle3": (dict(model=draft, num_speculative_tokens=3), target, "eagle3", EagleSpeculator),
             "specrl_mtp": (dict(num_speculative_tokens=1), mimo, "mtp", MTPSpeculator),
             "specrl_history": (dict(num_speculative_tokens=4), target, None, BaseSpeculator)}
    resolved = {}
    base_propose = inspect.signature(BaseSpeculator.propose)
    for method, (kwargs, target_cfg, base, base_cls) in cases.items():
        spec = SpeculativeConfig(method=method, target_model_config=target_cfg,
                                 target_parallel_config=ParallelConfig(), **kwargs)
        config = spec.speculator_config
        check(f"{method}: vLLM keeps the method and resolves it to {base!r}",
              spec.custom_method == method and spec.method == base, (spec.custom_method, spec.method))
        check(f"{method}: config is the package's", type(config).__module__ == "vllm_specrl.mrv2.configs",
              type(config).__name__)
        cls = resolve_obj_by_qualname(config.speculator_class)
        check(f"{method}: speculator subclasses vLLM's {base_cls.__name__}", issubclass(cls, base_cls), cls.__mro__[:3])
        check(f"{method}: nothing abstract left", not getattr(cls, "__abstractmethods__", None),
              sorted(getattr(cls, "__abstractmethods__", ())))
        check(f"{method}: propose's parameters are BaseSpeculator's",
              list(inspect.signature(cls.propose).parameters) == list(base_propose.parameters))
        check(f"{method}: built with req_states", "req_states" in inspect.signature(cls).parameters)
        resolved[method] = {"method": spec.method, "config": type(config).__name__, "speculator": cls.__name__,
                            "k": spec.num_speculative_tokens}
    # The history speculator runs on vLLM 0.34's class with stand-in request states (no device needed).
    import torch

    from vllm_specrl.mrv2.speculators import HistorySpeculator

    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4),
                          model_config=SimpleNamespace(max_model_len=64, get_vocab_size=lambda: 128, seed=0),
                          scheduler_config=SimpleNamespace(max_num_seqs=4),
                          additional_config={"specrl": {"history": {"cost_aware": False, "min_confidence": 0.01}}})
    tokens = torch.zeros(4, 64, dtype=torch.int32)
    tokens[0, :12] = torch.tensor([5, 6, 7, 8, 20, 21, 22, 23, 24, 25, 26, 27])
    states = SimpleNamespace(all_token_ids=SimpleNamespace(gpu=tokens),
                             total_len=SimpleNamespace(gpu=torch.tensor([12, 0, 0, 0], dtype=torch.int32)),
                             prompt_len=SimpleNamespace(np=torch.tensor([4, 0, 0, 0]).numpy()))
    speculator = HistorySpeculator(cfg, torch.device("cpu"), states)
    batch = SimpleNamespace(num_reqs=1, req_ids=["a"], idx_mapping=torch.tensor([0]), idx_mapping_np=[0])
    out = speculator.propose(batch, {}, {}, None, None, torch.tensor([1]), torch.tensor([0]), None, None, None, None)
    check("specrl_history: no history, no draft", out.tolist() == [[-1] * 4], out.tolist())
    speculator.on_requests_finished({"a"})  # its completion joins the prompt's history
    tokens[1, :6] = torch.tensor([5, 6, 7, 8, 20, 21])
    states.total_len.gpu[1], states.prompt_len.np[1] = 6, 4
    batch = SimpleNamespace(num_reqs=1, req_ids=["b"], idx_mapping=torch.tensor([1]), idx_mapping_np=[1])
    out = speculator.propose(batch, {}, {}, None, None, torch.tensor([1]), torch.tensor([0]), None, None, None, None)
    check("specrl_history drafts a sibling's continuation through vLLM 0.34's interface",
          out.tolist() == [[22, 23, 24, 25]], out.tolist())
    speculator.reset_state()
    report = {"vllm": vllm.__version__, "torch": torch.__version__, "plugin": {k: state.get(k) for k in (
        "status", "model_runner", "registrations")}, "resolved": resolved}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(resolved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
