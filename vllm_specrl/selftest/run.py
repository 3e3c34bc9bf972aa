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

from vllm_specrl.proposer.eagle3_config import TARGET_ARCHS
from vllm_specrl.selftest.engine_job import RESULT_TAG
from vllm_specrl.selftest.stats import per_position_pvalues

GROUPS = ("eagle3", "history", "updates", "capture", "status", "logprobs", "sleep")
# A lossless engine must not be rejected at this level (per position; a handful of positions).
ALPHA = 1e-3
SAMPLE_PROMPT = "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2, 3]\nw = [1, 2, 3]\nv ="
GREEDY_PROMPTS = ["def fibonacci(n):", "The capital of France is", "import os\nimport sys\n", "1, 2, 3, 4,"]
LOGPROB_TOKENS = 16
# Returned logprobs against the same tokens scored by plain vLLM and by an HF forward (float32): a
# bound on the engines' numerics, far below what a lossy path moves them by.
LOGPROB_TOLERANCE = 1e-3


@dataclass
class Check:
    name: str
    passed: bool
    detail: str
    skipped: bool = False  # the platform cannot run it (the detail says why)


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


def model_config(model: str) -> dict:
    """The checkpoint's config.json."""
    return json.loads((Path(model) / "config.json").read_text())


def random_draft(model: str, out: Path, seed: int) -> Path:
    """A random EAGLE-3 draft for ``model`` with half its vocabulary (the ``d2t``/``t2d`` maps served too):
    losslessness must hold whatever the draft proposes."""
    from vllm_specrl.proposer.checkpoint import init_draft

    init_draft(model, out, draft_vocab_size=model_config(model)["vocab_size"] // 2, seed=seed)
    return out


def has_mtp_layers(model: str) -> bool:
    """The checkpoint ships MTP layers vLLM drafts with (MiMo's, DeepSeek-style ``num_nextn_predict_layers``)."""
    config = model_config(model)
    return (any("MiMo" in a for a in config.get("architectures", []))
            or int(config.get("num_nextn_predict_layers") or 0) > 0)


def hf_logprobs(model: str, sequences: list[list[int]]) -> list[list[float | None]]:
    """Every token's logprob given the tokens before it, from a transformers forward in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for seq in sequences:
            logprobs = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
            out.append([None] + [float(logprobs[i - 1, seq[i]]) for i in range(1, len(seq))])
    return out


def _largest_gap(found: list[dict], reference: list[list[float | None]]) -> tuple[float, float]:
    """The largest |difference| over the sampled tokens' logprobs and over the prompts' (first token
    excepted), of ``found`` against ``reference`` scores of the same sequences."""
    sampled, prompt = 0.0, 0.0
    for item, ref in zip(found, reference):
        n = len(item["prompt_ids"])
        sampled = max([sampled] + [abs(a - b) for a, b in zip(item["logprobs"], ref[n:])])
        prompt = max([prompt] + [abs(a - b) for a, b in zip(item["prompt_logprobs"][1:], ref[1:n])])
    return sampled, prompt


def _logprob_check(name: str, found: dict, plain: list, hf: list | None) -> Check:
    if "error" in found or "logprobs" not in found:
        return Check(name, False, found.get("error", "no logprobs returned"))
    gaps = {"plain": _largest_gap(found["logprobs"], plain)}
    if hf is not None:
        gaps["HF"] = _largest_gap(found["logprobs"], hf)
    worst = max(max(g) for g in gaps.values())
    tokens = sum(len(item["token_ids"]) for item in found["logprobs"])
    drafts = int((found.get("spec_decode") or {}).get("num_drafts", 0))
    detail = (f"{tokens} sampled tokens at T = 1, {drafts} drafts verified: largest |logprob difference| sampled / "
              "prompt " + ", ".join(f"{k} {g[0]:.1e} / {g[1]:.1e}" for k, g in gaps.items())
              + f" (bound {LOGPROB_TOLERANCE:g})")
    return Check(name, worst <= LOGPROB_TOLERANCE and drafts > 0, detail)


def _sleep_check(model: str, base: dict, settings: Settings, progress: Callable[[str], None]) -> Check:
    """A level-2 sleep and wake-up of an EAGLE-3 engine, the policy reloaded as an RL job does: the drafter
    comes back (from the plugin's host copy) and serves exactly the acceptance it served before. SKIPPED
    where vLLM has no sleep mode (the CPU)."""
    from vllm.platforms import current_platform

    from vllm_specrl.rl.serving import serve_args

    name = "drafter survives sleep/wake"
    if not current_platform.is_sleep_mode_available():
        return Check(name, True, f"vLLM has no sleep mode on the {current_platform.device_type} platform",
                     skipped=True)
    progress("[selftest] EAGLE-3 through a level-2 sleep and wake-up")
    with tempfile.TemporaryDirectory(prefix="specrl-selftest-sleep-") as tmp:
        draft = random_draft(model, Path(tmp) / "draft", seed=0)
        found = run_engine({**base, "speculative_config": serve_args("eagle3", draft=draft).speculative_config,
                            "plugin": True, "sleep": True}, plugin=True,
                           timeout_s=settings.timeout_s, env=settings.env)
    if "error" in found:
        return Check(name, False, found["error"])
    cycle = found["sleep"]
    same = cycle["before"] == cycle["after"]
    return Check(name, same,
                 f"greedy tokens and acceptance {'the same' if same else 'CHANGED'} after the cycle "
                 f"({cycle['before']['spec_decode']['num_accepted_tokens']} tokens accepted each time); "
                 f"{cycle['repairs']} drafter repair(s) at wake-up")


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
    from vllm_specrl.rl.serving import serve_args
    from vllm_specrl.launcher import free_port

    model, groups, checks = str(settings.model), settings.groups, []
    greedy = {"prompts": GREEDY_PROMPTS, "max_tokens": settings.greedy_tokens}
    samples = {"prompt": SAMPLE_PROMPT, "n": settings.samples, "tokens": settings.sample_tokens}
    base = {"model": model, "dtype": settings.dtype, "greedy": greedy}
    with tempfile.TemporaryDirectory(prefix="specrl-selftest-") as tmp:
        t0 = time.time()
        progress(f"[selftest] plain vLLM (no plugin): {len(GREEDY_PROMPTS)} greedy prompts, "
                 f"{settings.samples} samples at T = 1")
        sampled = {"eagle3", "history"} & set(groups)  # the T = 1 distribution checks need plain's samples
        plain = run_engine({**base, "samples": samples if sampled else None, "seed": 1}, plugin=False,
                           timeout_s=settings.timeout_s)
        if "error" in plain:
            return [Check("plain vLLM runs", False, plain["error"])]
        logprobs = {"prompts": GREEDY_PROMPTS, "tokens": LOGPROB_TOKENS} if "logprobs" in groups else None
        with_logprobs: dict[str, dict] = {}
        eagle3_groups = {"eagle3", "updates", "capture", "status", "logprobs"} & set(groups)
        architectures = model_config(model).get("architectures", [])
        if eagle3_groups and not set(architectures) & set(TARGET_ARCHS):
            checks += [Check(f"EAGLE-3 ({g})", True, f"an EAGLE-3 draft needs one of {', '.join(TARGET_ARCHS)} as its "
                             f"target, not {', '.join(architectures)}", skipped=True) for g in sorted(eagle3_groups)]
            eagle3_groups = set()
        if eagle3_groups:
            draft = random_draft(model, Path(tmp) / "draft", seed=0)
            fresh = random_draft(model, Path(tmp) / "fresh-draft", seed=1)
            job = {**base, "speculative_config": serve_args("eagle3", draft=draft).speculative_config, "plugin": True,
                   "seed": 5, "fresh_draft": str(fresh),
                   "samples": samples if "eagle3" in groups else None, "updates": "updates" in groups,
                   "logprobs": logprobs,
                   "capture": f"tcp://127.0.0.1:{free_port()}" if "capture" in groups else None}
            progress(f"[selftest] EAGLE-3, random draft ({time.time() - t0:.0f} s so far)")
            found = run_engine(job, plugin=True, timeout_s=settings.timeout_s, env=settings.env)
            if logprobs:
                with_logprobs["EAGLE-3"] = found
            if "eagle3" in groups:
                checks += [_greedy("EAGLE-3 greedy = plain", plain["greedy"], found),
                           _distribution("EAGLE-3 T=1 distribution = plain", plain["samples"], found)]
            if "error" in found:
                checks += [Check(g, False, found["error"]) for g in ("updates", "capture", "status") if g in groups]
            else:
                checks += _update_checks(plain["greedy"], found) if "updates" in groups else []
                checks += [_capture_check(found)] if "capture" in groups else []
                checks += [_status_check(found)] if "status" in groups else []
        if {"history", "logprobs"} & set(groups):
            progress(f"[selftest] history proposer ({time.time() - t0:.0f} s so far)")
            history = serve_args("history").speculative_config
            found = run_engine({**base, "samples": samples if "history" in groups else None,
                                "speculative_config": history, "plugin": True, "seed": 8, "logprobs": logprobs},
                               plugin=True, timeout_s=settings.timeout_s, env=settings.env)
            if logprobs:
                with_logprobs["history"] = found
            if "history" in groups:
                checks += [_greedy("history greedy = plain", plain["greedy"], found),
                           _distribution("history T=1 distribution = plain", plain["samples"], found)]
        if logprobs and has_mtp_layers(model):
            progress(f"[selftest] the policy's own MTP layers ({time.time() - t0:.0f} s so far)")
            with_logprobs["MTP"] = run_engine({**base, "greedy": None, "speculative_config": serve_args("mtp")
                                               .speculative_config, "plugin": True, "seed": 9, "logprobs": logprobs},
                                              plugin=True, timeout_s=settings.timeout_s, env=settings.env)
        if logprobs and with_logprobs:
            checks += _logprob_checks(model, base, with_logprobs, settings, progress, t0)
        if "sleep" in groups:
            checks.append(_sleep_check(model, base, settings, progress))
        progress(f"[selftest] done in {time.time() - t0:.0f} s")
    return checks


def _logprob_checks(model: str, base: dict, with_logprobs: dict[str, dict], settings: Settings,
                    progress: Callable[[str], None], t0: float) -> list[Check]:
    """The proposers' returned logprobs against plain vLLM scoring the same sequences, and an HF forward."""
    sequences = [item["prompt_ids"] + item["token_ids"] for found in with_logprobs.values()
                 for item in found.get("logprobs", [])]
    progress(f"[selftest] plain vLLM scoring {len(sequences)} sampled sequences ({time.time() - t0:.0f} s so far)")
    scored = run_engine({**base, "greedy": None, "score": sequences}, plugin=False, timeout_s=settings.timeout_s)
    if "error" in scored:
        return [Check(f"{name} logprobs = plain", False, scored["error"]) for name in with_logprobs]
    try:
        hf = hf_logprobs(model, sequences)
    except Exception as exc:  # noqa: BLE001 - an architecture transformers cannot load: plain vLLM alone judges
        progress(f"[selftest] no HF forward for this model ({exc!r}): logprobs checked against plain vLLM only")
        hf = None
    checks, at = [], 0
    for name, found in with_logprobs.items():
        n = len(found.get("logprobs", []))
        checks.append(_logprob_check(f"{name} logprobs = plain", found, scored["scored"][at:at + n],
                                     hf[at:at + n] if hf is not None else None))
        at += n
    return checks


def format_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':{width}}  result  detail"]
    lines += [f"{c.name:{width}}  {'SKIP' if c.skipped else 'PASS' if c.passed else 'FAIL':6}  {c.detail}"
              for c in checks]
    failed, skipped = sum(not c.passed for c in checks), sum(c.skipped for c in checks)
    lines.append(f"selftest: {len(checks) - failed - skipped} passed, {failed} failed, {skipped} skipped")
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
