"""Every switch a user can set: environment variables and ``--additional-config '{"specrl": {...}}'`` keys.

One list, which the README's table is checked against and which ``tests/test_switches.py`` checks
against the package's source (a ``VLLM_SPECRL_*`` name or a ``specrl`` config key read anywhere must be
here). ``ineffective`` names the switches set where they do nothing, which the API server logs at
start-up and ``/specrl/status`` reports, rather than ignoring them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_specrl.adaptive import SCHEDULER_CLS as ADAPTIVE_K_SCHEDULER
from vllm_specrl.compat.registry import SHORTCUTS_SWITCH
from vllm_specrl.lifecycle.config import DRAFT_MODEL_METHODS

HISTORY_PROPOSER = "vllm_specrl.proposer.history.HistoryProposer"


@dataclass(frozen=True)
class Switch:
    name: str      # the environment variable, or the key under --additional-config's "specrl"
    kind: str      # "env" or "config"
    default: str
    effect: str
    group: str = ""  # "cpu": a CPU performance shortcut (docs/cpu-shortcuts.md), all off with CPU_SHORTCUTS


ENV, CONFIG = "env", "config"
CPU = "cpu"  # the group of the CPU performance shortcuts
PATCH_SWITCH = "`0` keeps vLLM's own path; `1` installs it on a platform other than the CPU too"

SWITCHES: tuple[Switch, ...] = (
    # Serving and security
    Switch("allow_unauthenticated_remote", CONFIG, "false",
           "without `--api-key`, let non-loopback clients call the control routes (`/specrl/update/*`)"),
    Switch("VLLM_SPECRL_ALLOW_UNAUTHENTICATED_REMOTE", ENV, "unset", "the same as `allow_unauthenticated_remote`"),
    Switch("update_idle_timeout_s", CONFIG, "300", "a staged update with no new chunk for this long is aborted"),
    Switch("policy_rollback", CONFIG, "true", "keep the last committed policy in host memory to restore if an "
           "apply fails; `false`: no copy held (a failed apply pauses generation until a complete update)"),
    Switch("shared_staging", CONFIG, "true", "tensor-parallel ranks of a host map one shared-memory copy of an "
           "update; `false`: each rank copies it"),
    Switch("VLLM_SPECRL_API_KEY", ENV, "unset", "the API key `EngineClient`, `train-draft`, `DraftTrainerProcess` "
           "and the TRL adapter send when none is passed"),
    Switch("VLLM_SPECRL_CALIBRATION_TOKEN", ENV, "made by the plugin",
           "the secret in the start-up sweep's request ids, inherited by the engine's processes; `vllm-specrl "
           "calibrate` gets it from `POST /specrl/calibrate` (the API key); set it only to share one across engines "
           "started apart"),
    Switch("VLLM_SPECRL_SHM_DIR", ENV, "/dev/shm", "where shared-memory weight chunks are written and accepted"),
    # Speculation
    Switch("adaptive_k", CONFIG, "true (with the scheduler)",
           f"adaptive k's knobs (`AdaptiveKConfig`), `false` to serve fixed k; needs `--scheduler-cls "
           f"{ADAPTIVE_K_SCHEDULER}`"),
    Switch("history", CONFIG, "defaults", f"the history proposer's index knobs (`HistoryConfig`); needs "
                                          f"`\"method\": \"custom_class\", \"model\": \"{HISTORY_PROPOSER}\"`"),
    Switch("VLLM_SPECRL_WEIGHT_WATCH", ENV, "unset", "`0` leaves loads through vLLM's native weight-transfer API, "
           "`reload_weights` and worker extensions unwatched (no versions, draft validation or repair there)"),
    Switch("VLLM_SPECRL_MAX_DRAFT_LAG", ENV, "2", "policy versions a draft may lag before the stale-draft guard warns"),
    Switch("VLLM_SPECRL_STALE_MIN_DRAFTS", ENV, "64", "drafts the guard waits for before it judges acceptance"),
    Switch("drafter", CONFIG, "repair, 30 s",
           "the drafter's lifecycle (`DrafterConfig`): `on_damage` (`repair`, `report` "
           "or `refuse`), `check_every_s`, the collapse alarm's `collapse_window`/`collapse_below`/`collapse_drop`"),
    # Capture
    Switch("capture", CONFIG, "unset", "stream committed rows to this ZMQ address from start-up (needs the worker "
                                       "extension)"),
    Switch("capture_fraction", CONFIG, "1.0", "share of requests captured (needs `capture` or a capture start)"),
    Switch("capture_topk", CONFIG, "64", "top-k target logprobs sent with every row (0: none)"),
    Switch("capture_dtype", CONFIG, "bfloat16", "dtype of the hidden states sent (`bfloat16` or `float32`)"),
    Switch("capture_queue_frames", CONFIG, "256", "frames the sender queues before it drops and counts"),
    Switch("capture_send_timeout_s", CONFIG, "0", "seconds a send may block (0: never; a full queue drops)"),
    Switch("capture_sender_cpus", CONFIG, "auto", "CPUs the capture sender runs on (`auto`: off the forward's core)"),
    Switch("capture_sender", CONFIG, "auto", "`process`: the capture sender in a process of its own, `thread`: in "
                                             "the worker; `auto`: a process where it has CPUs of its own"),
    Switch("capture_sender_sched", CONFIG, "auto", "`idle`: the capture sender at SCHED_IDLE, `normal`; `auto`: idle "
                                                   "on CPUs of its own when it drops rather than waits"),
    Switch("capture_allow_remote", CONFIG, "false", "allow a non-loopback capture address"),
    Switch("VLLM_SPECRL_CAPTURE_TAP", ENV, "unset", "`0` refuses to install the capture tap (capture off)"),
    Switch("VLLM_SPECRL_DRAFT_RECORDER", ENV, "unset", "`0` refuses to install the draft recorder"),
    # Engine patches (each listed by `vllm-specrl doctor` and docs/vllm_touch_points.md)
    Switch(SHORTCUTS_SWITCH, ENV, "on (CPU)", "`0` turns off every CPU performance shortcut whose own switch is "
                                              "unset (vLLM's own paths; the fixes of vLLM faults stay): "
                                              "docs/cpu-shortcuts.md lists each"),
    Switch("VLLM_SPECRL_FAST_SAMPLING", ENV, "on (CPU)", f"the CPU's inverse-CDF samplers; {PATCH_SWITCH}", group=CPU),
    Switch("VLLM_SPECRL_LAZY_REJECTION", ENV, "on (CPU)",
           f"recovered tokens and logprobs only where emitted; {PATCH_SWITCH}", group=CPU),
    Switch("VLLM_SPECRL_ONE_PASS_VERIFY", ENV, "on (CPU)", f"verify from one log-softmax; {PATCH_SWITCH}", group=CPU),
    Switch("VLLM_SPECRL_DRAFT_VOCAB_SAMPLING", ENV, "on (CPU)",
           f"EAGLE-3 drafts sampled in their own vocabulary; {PATCH_SWITCH}", group=CPU),
    Switch("VLLM_SPECRL_COMPACT_DRAFT_PROBS", ENV, "on", "`0` spreads draft probabilities over the target's "
                                                         "vocabulary in the drafter"),
    Switch("VLLM_SPECRL_ZERO_DRAFT_PLAIN_SAMPLER", ENV, "on (CPU)",
           f"steps without drafts take the plain sampler and a short metadata path; {PATCH_SWITCH}", group=CPU),
    Switch("VLLM_SPECRL_DEFER_DRAFT_KV", ENV, "on (CPU)", f"the drafter's k = 0 passes deferred; {PATCH_SWITCH}",
           group=CPU),
    Switch("VLLM_SPECRL_SKIP_EMPTY_DRAFT_FETCH", ENV, "on (CPU)",
           f"no draft fetch after a k = 0 step; {PATCH_SWITCH}", group=CPU),
    Switch("VLLM_SPECRL_RUNNER_STEP_TIMER", ENV, "on (CPU)", f"the runner's step time for adaptive k; {PATCH_SWITCH}",
           group=CPU),
    Switch("VLLM_SPECRL_CUSTOM_PROPOSER_BINDING", ENV, "on", "`0` leaves custom_class proposers without the "
                                                             "runner's batch (the history proposer needs it)"),
    Switch("VLLM_SPECRL_CPU_EXPAND_FIX", ENV, "on where the fault is", "`0` leaves vLLM CPU's expand-kernel fault "
                                                                       "(lossy T > 0 on vLLM's own samplers)"),
    Switch("VLLM_SPECRL_CPU_SEEDED_REWIND_FIX", ENV, "on where the fault is",
           "`0` leaves vLLM CPU's seeded-rewind fault (engine error on seeded chunked prefills)"),
    Switch("VLLM_SPECRL_CPU_START_METHOD", ENV, "unset (spawn)", "`fork`: vLLM's CPU engine core and worker forked, "
                                                                 "not spawned (faster start-up)", group=CPU),
    Switch("VLLM_SPECRL_MALLOC_TUNING", ENV, "on (CPU)", "`0` keeps glibc malloc's default thresholds", group=CPU),
    # Testing and development
    Switch("VLLM_SPECRL_FAULTS", ENV, "unset", "fault injection for tests (never set it when serving)"),
    Switch("VLLM_SPECRL_FIXTURES", ENV, "~/.cache/vllm-specrl/fixtures", "where fixture models are built and found"),
)


def ineffective(additional: Mapping[str, Any], scheduler_cls: str | None, speculative: Any,
                environ: Mapping[str, str] | None = None) -> list[str]:
    """The switches set here that change nothing, each with what it would need."""
    environ = os.environ if environ is None else environ
    method = getattr(speculative, "method", None)
    found = []
    if "adaptive_k" in additional and str(scheduler_cls or "") != ADAPTIVE_K_SCHEDULER:
        found.append(f"adaptive_k is set but the scheduler is {scheduler_cls or 'vLLM default'}: fixed k is served "
                     f"(add --scheduler-cls {ADAPTIVE_K_SCHEDULER})")
    if "adaptive_k" in additional and speculative is None:
        found.append("adaptive_k is set but nothing is speculated (no --speculative-config)")
    if "history" in additional and str(getattr(speculative, "model", "")) != HISTORY_PROPOSER:
        found.append(f"history is set but the proposer is {method or 'none'}: the history index is not used")
    if "drafter" in additional and method not in DRAFT_MODEL_METHODS:
        found.append(f"drafter is set but the proposer is {method or 'none'}: there is no draft model to keep")
    capture_knobs = sorted(k for k in additional if k.startswith("capture_"))
    if capture_knobs and not additional.get("capture"):
        found.append(f"{', '.join(capture_knobs)} set without capture: they apply only once capture starts "
                     "(set capture, or start it through /specrl/capture)")
    for switch in SWITCHES:
        value = environ.get(switch.name)
        if switch.kind == ENV and value is not None and PATCH_SWITCH in switch.effect and value not in ("0", "1"):
            found.append(f"{switch.name}={value!r} is neither 0 nor 1: the platform's default applies")
    return found
