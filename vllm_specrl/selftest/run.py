"""``vllm-specrl selftest``: run the product's promises on this machine's vLLM and print a pass/fail table.

Three engines, one after another, each in a process of its own (``engine_job``): stock vLLM without the
plugin (the reference), an EAGLE-3 engine with a random draft (greedy outputs, temperature-1 samples,
policy and draft updates applied and refused, capture, the worker's status and patches) and the
history proposer (greedy outputs, temperature-1 samples). A random draft is enough: losslessness
must hold whatever the draft proposes, and a random draft's drafts are still verified (the rows
report how many). Exit status 1 when any check fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_specrl.selftest.engine_job import RESULT_TAG
from vllm_specrl.selftest.stats import per_position_pvalues

GROUPS = ("eagle3", "history", "updates", "capture", "status")
# A lossless engine must not be rejected at this level (per position; a handful of positions).
ALPHA = 1e-3
SAMPLE_PROMPT = "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2, 3]\nw = [1, 2, 3]\nv ="
GREEDY_PROMPTS = ["def fibonacci(n):", "The capital of France is", "import os\nimport sys\n", "1, 2, 3, 4,"]


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class Settings:
    model: Path
    samples: int = 3000
    sample_tokens: int = 6
    greedy_tokens: int = 24
    groups: tuple[str, ...] = GROUPS
    dtype: str = "float32"
    timeout_s: float = 900.0
    env: dict[str, str] | None = None  # extra environment of the plugin's engines (a switch to try)


def default_model() -> Path:
    """The package's tiny fixture (a 4-layer Llama and its tokenizer), built once into the user's cache."""
    from vllm_specrl.fixtures import build_fixtures
    from vllm_specrl.fixtures.layout import target_dir

    root = Path(os.environ.get("VLLM_SPECRL_FIXTURES", Path.home() / ".cache" / "vllm-specrl" / "fixtures"))
    build_fixtures(root, ("tiny",))
    return target_dir(root, "tiny")


def run_engine(job: dict, plugin: bool, timeout_s: float, env: dict[str, str] | None = None) -> dict:
    """One ``engine_job`` process; its ``SELFTEST`` result, or ``{"error": ...}`` with its output's tail."""
    full_env = dict(os.environ)
    full_env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": "specrl" if plugin else "none"})
    full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    full_env.update(env or {})
    try:
        proc = subprocess.run([sys.executable, "-m", "vllm_specrl.selftest.engine_job", json.dumps(job)],
                              env=full_env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"the engine did not finish within {timeout_s:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG + " "):
            return json.loads(line[len(RESULT_TAG) + 1:])
    return {"error": f"exit status {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}"}


def _distribution(name: str, plain: list[list[int]], spec: dict) -> Check:
    if "error" in spec:
        return Check(name, False, spec["error"])
    p = per_position_pvalues(plain, spec["samples"])
    stats = spec.get("spec_decode") or {}
    drafts, accepted = stats.get("num_drafts", 0), stats.get("num_accepted_tokens", 0)
    detail = f"min p = {min(p):.2g} over {len(p)} positions; {drafts:.0f} drafts, {accepted:.0f} tokens accepted"
    return Check(name, min(p) > ALPHA and drafts > 0, detail)


def _greedy(name: str, plain: list[list[int]], spec: dict) -> Check:
    if "error" in spec:
        return Check(name, False, spec["error"])
    same = sum(a == b for a, b in zip(plain, spec["greedy"]))
    return Check(name, same == len(plain), f"{same} of {len(plain)} prompts token-for-token equal to plain vLLM")


def _update_checks(plain_greedy: list[list[int]], found: dict) -> list[Check]:
    u = found["updates"]
    before = u["before"]
    versions = u.get("versions") or {}
    return [
        Check("policy update applied", u["perturbed"]["ok"] and u["after_perturbed"] != before
              and u["restored"]["ok"] and u["after_restored"] == before,
              "a perturbed policy changed the outputs; the original weights restored them exactly"
              if u["perturbed"]["ok"] else f"refused: {u['perturbed']}"),
        Check("policy update refused when malformed", not u["malformed_policy"]["ok"]
              and u["after_malformed_policy"] == before and versions.get("policy") == 2,
              f"{u['malformed_policy_kind']}: {u['malformed_policy'].get('error')}; still serving policy "
              f"v{versions.get('policy')}"),
        Check("draft update applied", u["draft"]["ok"] and u["after_draft"] == plain_greedy,
              "a fresh draft serves; outputs still plain vLLM's" if u["draft"]["ok"] else f"refused: {u['draft']}"),
        Check("draft update refused when malformed", not u["malformed_draft"]["ok"]
              and u["after_malformed_draft"] == plain_greedy and versions.get("draft") == 1,
              f"{u['malformed_draft_kind']}: {u['malformed_draft'].get('error')}; still serving draft "
              f"v{versions.get('draft')}"),
    ]


def _capture_check(found: dict) -> Check:
    c = found["capture"]
    if not c["started"].get("ok"):
        return Check("capture delivers rows", False, f"capture did not start: {c['started']}")
    # Every request's rows arrive once, from position 0, carrying its prompt and output tokens (the
    # last output token has no row yet: its hidden state comes with the next step).
    matched = sum(any(got == want[:len(got)] and len(got) >= len(want) - 1 for got in c["captured"])
                  for want in c["expected"])
    rows = sum(len(got) for got in c["captured"])
    return Check("capture delivers rows", matched == len(c["expected"]),
                 f"{matched} of {len(c['expected'])} requests' rows received ({rows} rows; sender "
                 f"dropped {c['sender'].get('dropped_frames', 0)} frames)")


def _status_check(found: dict) -> Check:
    plugin = (found.get("status") or {}).get("plugin", {})
    patches = plugin.get("patches", [])
    failed = [p["name"] for p in patches if p["state"] == "failed"]
    installed = [p["name"] for p in patches if p["state"] == "installed"]
    return Check("status and patches", plugin.get("status") == "active" and bool(patches) and not failed,
                 f"plugin {plugin.get('status')} in the worker; {len(installed)} of {len(patches)} patches "
                 f"installed" + (f"; failed: {failed}" if failed else ""))


def selftest(settings: Settings, progress: Callable[[str], None] = print) -> list[Check]:
    """Run the checks of ``settings.groups``; one ``Check`` per promise."""
    from vllm_specrl.proposer.checkpoint import init_draft
    from vllm_specrl.rl.serving import serve_args
    from vllm_specrl.server import free_port

    model, groups, checks = str(settings.model), settings.groups, []
    greedy = {"prompts": GREEDY_PROMPTS, "max_tokens": settings.greedy_tokens}
    samples = {"prompt": SAMPLE_PROMPT, "n": settings.samples, "tokens": settings.sample_tokens}
    base = {"model": model, "dtype": settings.dtype, "greedy": greedy}
    with tempfile.TemporaryDirectory(prefix="specrl-selftest-") as tmp:
        t0 = time.time()
        progress(f"[selftest] plain vLLM (no plugin): {len(GREEDY_PROMPTS)} greedy prompts, "
                 f"{settings.samples} samples at T = 1")
        plain = run_engine({**base, "samples": samples, "seed": 1}, plugin=False, timeout_s=settings.timeout_s)
        if "error" in plain:
            return [Check("plain vLLM runs", False, plain["error"])]
        if {"eagle3", "updates", "capture", "status"} & set(groups):
            draft, fresh = Path(tmp) / "draft", Path(tmp) / "fresh-draft"
            vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
            init_draft(model, draft, draft_vocab_size=vocab // 2, seed=0)
            init_draft(model, fresh, draft_vocab_size=vocab // 2, seed=1)
            job = {**base, "speculative_config": serve_args("eagle3", draft=draft).speculative_config, "plugin": True, "seed": 5, "fresh_draft": str(fresh),
                   "samples": samples if "eagle3" in groups else None, "updates": "updates" in groups,
                   "capture": f"tcp://127.0.0.1:{free_port()}" if "capture" in groups else None}
            progress(f"[selftest] EAGLE-3, random draft ({time.time() - t0:.0f} s so far)")
            found = run_engine(job, plugin=True, timeout_s=settings.timeout_s, env=settings.env)
            if "eagle3" in groups:
                checks += [_greedy("EAGLE-3 greedy = plain", plain["greedy"], found),
                           _distribution("EAGLE-3 T=1 distribution = plain", plain["samples"], found)]
            if "error" in found:
                checks += [Check(g, False, found["error"]) for g in ("updates", "capture", "status") if g in groups]
            else:
                checks += _update_checks(plain["greedy"], found) if "updates" in groups else []
                checks += [_capture_check(found)] if "capture" in groups else []
                checks += [_status_check(found)] if "status" in groups else []
        if "history" in groups:
            progress(f"[selftest] history proposer ({time.time() - t0:.0f} s so far)")
            history = serve_args("history").speculative_config
            found = run_engine({**base, "samples": samples, "speculative_config": history, "plugin": True,
                                "seed": 8}, plugin=True, timeout_s=settings.timeout_s, env=settings.env)
            checks += [_greedy("history greedy = plain", plain["greedy"], found),
                       _distribution("history T=1 distribution = plain", plain["samples"], found)]
        progress(f"[selftest] done in {time.time() - t0:.0f} s")
    return checks


def format_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':{width}}  result  detail"]
    lines += [f"{c.name:{width}}  {'PASS' if c.passed else 'FAIL':6}  {c.detail}" for c in checks]
    failed = sum(not c.passed for c in checks)
    lines.append(f"selftest: {len(checks) - failed} passed, {failed} failed")
    return "\n".join(lines)


def as_json(checks: list[Check], settings: Settings, seconds: float | None = None) -> dict[str, Any]:
    """The results with the machine and versions they were found on."""
    import vllm

    from vllm_specrl._version import __version__
    from vllm_specrl.host import host_info

    return {"selftest": "vllm-specrl", "vllm_specrl": __version__, "vllm": vllm.__version__, "host": host_info(),
            "date": time.strftime("%Y-%m-%d"), "seconds": seconds, "model": str(settings.model),
            "groups": list(settings.groups), "samples": settings.samples,
            "checks": [c.__dict__ for c in checks], "passed": all(c.passed for c in checks)}
