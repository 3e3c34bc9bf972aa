"""The staleness run's report (``rl_run.py``): per-step means over seeds, windows, the issue's goals, the
RL-level lossless test, and the plot. No engine here: everything is computed from the runs' JSONs, so the
report can be rebuilt (``python scripts/rl_run_report.py OUT_DIR``) and tested on its own.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

# Each arm's proposer; the speculative arms are those with a draft
PROPOSER = {"plain": "plain", "frozen": "eagle3", "online": "eagle3", "online-async": "eagle3", "lossy": "plain"}
ARMS = tuple(PROPOSER)
SPECULATIVE = tuple(arm for arm, proposer in PROPOSER.items() if proposer != "plain")
ALPHA = 0.05  # family-wise, per arm (Holm over its outcomes, step buckets and final values)


def mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def per_step(runs: list[dict], key: str) -> list[float | None]:
    """Step-by-step mean of ``key`` over the runs (seeds) of one arm."""
    steps = min(len(r["steps"]) for r in runs)
    return [mean([r["steps"][i][key] for r in runs]) for i in range(steps)]


def window_bounds(steps: int, window: int, switch_at: int | None = None) -> list[tuple[int, int]]:
    """[lo, hi) of consecutive windows of ``window`` steps; with a switch, windows restart at it, so none
    straddles it (the last before it and the last of the run may be shorter)."""
    cuts = [0, steps] if switch_at is None or not 0 < switch_at < steps else [0, switch_at, steps]
    return [(i, min(i + window, hi)) for lo, hi in zip(cuts, cuts[1:]) for i in range(lo, hi, window)]


def window_means(values: list[float | None], window: int, switch_at: int | None = None) -> list[float | None]:
    """Means over ``window_bounds``."""
    return [mean(values[lo:hi]) for lo, hi in window_bounds(len(values), window, switch_at)]


def welch_p(a: list[float], b: list[float]) -> float:
    """Two-sided Welch's t-test p-value of equal means (1.0 where both samples are constant and equal)."""
    from scipy import stats

    if len(a) < 2 or len(b) < 2:
        return float("nan")
    if statistics.pvariance(a) == 0 and statistics.pvariance(b) == 0:
        return 1.0 if mean(a) == mean(b) else 0.0
    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def holm(pvalues: list[float], alpha: float = ALPHA) -> list[bool]:
    """Holm-Bonferroni: which hypotheses are rejected at family-wise ``alpha``."""
    order = sorted(range(len(pvalues)), key=pvalues.__getitem__)
    rejected = [False] * len(pvalues)
    for rank, i in enumerate(order):
        if pvalues[i] > alpha / (len(pvalues) - rank):
            break
        rejected[i] = True
    return rejected


OUTCOMES = ("mean_reward", "kl_from_start")  # what a run's training did: its reward, and how far its policy moved


def lossless_test(by_arm: dict[str, list[dict]], window: int, switch_at: int | None = None, last: int = 5) -> dict:
    """Does speculation change the RL run? Per arm against plain, for each outcome (the reward, and the KL of
    the policy from the start on held-out prompts: lossless sampling leaves both where plain's are): Welch's
    t-test on the per-seed means in every bucket of ``window`` steps and over the last ``last`` steps (the
    final value), Holm-corrected over all of an arm's tests at family-wise ``ALPHA``. The seeds are the
    independent units (samples within a run share its policy's trajectory). An arm fails where any test
    rejects equality."""
    if "plain" not in by_arm:
        return {"tested": False, "why": "no plain arm"}
    out: dict = {"tested": True, "test": f"Welch's t on per-seed means of {' and '.join(OUTCOMES)} per {window}-step "
                                         f"bucket and over the last {last} steps, Holm at {ALPHA} over them all",
                 "arms": {}}
    plain = by_arm["plain"]
    for arm, runs in by_arm.items():
        if arm == "plain":
            continue
        if min(len(runs), len(plain)) < 2:
            out["arms"][arm] = {"tested": False, "why": f"{len(runs)} seed(s) against plain's {len(plain)}: "
                                                        "the test needs at least 2 of each (3 asked)"}
            continue
        steps = min(len(r["steps"]) for r in runs + plain)
        buckets = window_bounds(steps, window, switch_at) + [(max(0, steps - last), steps)]

        def seed_means(rs: list[dict], key: str, lo: int, hi: int) -> list[float]:
            return [mean([s[key] for s in r["steps"][lo:hi]]) for r in rs]

        rows = []
        for key in OUTCOMES:
            for lo, hi in buckets:
                a, b = seed_means(runs, key, lo, hi), seed_means(plain, key, lo, hi)
                if None in a + b:
                    continue
                rows.append({"outcome": key, "steps": [lo, hi - 1], "arm": mean(a), "plain": mean(b),
                             "seed_sd": statistics.stdev(b) if len(b) > 1 else None, "p": welch_p(a, b),
                             "final": (lo, hi) == buckets[-1]})
        rejected = holm([r["p"] if not math.isnan(r["p"]) else 1.0 for r in rows])
        for r, rej in zip(rows, rejected):
            r["rejected"] = rej
        rejected_by = sorted({r["outcome"] for r in rows if r["rejected"]})
        out["arms"][arm] = {"tested": True, "buckets": rows, "agrees_with_plain": not rejected_by,
                            "rejected_on": rejected_by, "min_p": min((r["p"] for r in rows), default=None)}
    return out


def final_eval(runs: list[dict]) -> dict | None:
    """Served acceptance length on each run's final policy of the draft it ended with and of the starting
    draft (``rl_run.final_drafts_eval``), mean over the seeds that have it (runs recorded before it existed
    have none); None where no run has it."""
    evals = [e for r in runs for e in [r.get("final_drafts_eval")] if e and "starting" in e]
    if not evals:
        return None
    ended = mean([e["ended_with"]["acceptance_length"] for e in evals])
    starting = mean([e["starting"]["acceptance_length"] for e in evals])
    return {"ended_with": ended, "starting": starting,
            "gain": ended - starting if None not in (ended, starting) else None,
            "runs": len(evals), "drafts": [e["ended_with"]["num_drafts"] for e in evals]}


def logprob_check(runs: list[dict]) -> dict:
    """The trainer's recomputed logprobs against vLLM's returned ones for on-policy samples, over the arm."""
    maxima = [s["on_policy_logprob_abs_diff_max"] for r in runs for s in r["steps"]
              if s["on_policy_logprob_abs_diff_max"] is not None]
    means = [s["on_policy_logprob_abs_diff_mean"] for r in runs for s in r["steps"]
             if s["on_policy_logprob_abs_diff_mean"] is not None]
    return {"max": max(maxima) if maxima else None, "mean": mean(means), "steps_checked": len(maxima)}


def recovery(al: list[float | None], trainer_s: list[float | None], switch_at: int, window: int) -> dict:
    """After the switch: steps until the online arm's windowed acceptance length is back within 0.05 of its
    window before the switch, and the trainer CPU seconds that took."""
    pre = mean(al[max(0, switch_at - window) : switch_at])
    out: dict = {"pre_switch_window": pre, "post_switch_window": mean(al[switch_at : switch_at + window]),
                 "after_switch": mean(al[switch_at:]), "recovered_after_steps": None, "trainer_cpu_s": None}
    if pre is None:
        return out
    for j in range(switch_at, len(al) - window + 1):
        w = mean(al[j : j + window])
        if w is not None and w >= pre - 0.05:
            out["recovered_after_steps"] = j - switch_at
            if trainer_s[j] is not None and trainer_s[switch_at] is not None:
                out["trainer_cpu_s"] = trainer_s[j] - trainer_s[switch_at]
            break
    return out


def goals(arms: dict[str, dict], window: int, switch_at: int | None, lossless: dict) -> dict:
    """The staleness issue's goals, each met, missed, or not measured (with why). Online goals per online arm
    (``online``, ``online-async``, or a trainer variant whose arm name starts with ``online``)."""
    out: dict = {}
    frozen = arms.get("frozen")
    online_arms = [a for a in arms if a.startswith("online")]
    if frozen:
        fw = frozen["window_acceptance_length"]
        end = len(frozen["acceptance_length"]) if switch_at is None else switch_at
        last = max(1, min(10, end // 2))
        f_last = mean(frozen["acceptance_length"][end - last : end])
        fall = fw[0] - f_last if None not in (fw[0], f_last) else None
        out["frozen_fall"] = {"first_window": fw[0], f"last_{last}_steps": f_last, "fall": fall,
                              "stale": fall is not None and fall >= 0.15}
        for name in online_arms:
            online = arms[name]
            o_first, o_last = online["window_acceptance_length"][0], mean(online["acceptance_length"][end - last : end])
            if out["frozen_fall"]["stale"]:
                out[f"{name}_holds"] = {"first_window": o_first, f"last_{last}_steps": o_last,
                                        "met": o_last >= o_first - 0.05}
                out[f"{name}_beats_frozen"] = {"margin": o_last - f_last, "met": o_last - f_last >= 0.15}
            else:
                out[f"{name}_holds"] = out[f"{name}_beats_frozen"] = {
                    "met": None, "why": "the frozen draft did not fall by 0.15 over the run: nothing to recover",
                    "margin": o_last - f_last if None not in (o_last, f_last) else None}
    if switch_at is not None:
        for name in online_arms:
            rec = arms[name].get("recovery", {})
            steps = rec.get("recovered_after_steps")
            out[f"{name}_switch_recovery"] = {**rec, "met": steps is not None and steps <= 5}
            if frozen and frozen.get("recovery", {}).get("after_switch") is not None and rec.get("after_switch"):
                out[f"{name}_switch_recovery"]["after_switch_minus_frozen"] = (
                    rec["after_switch"] - frozen["recovery"]["after_switch"])
    if lossless.get("tested"):
        verdicts = {a: v["agrees_with_plain"] for a, v in lossless["arms"].items() if v.get("tested")}
        out["rl_lossless"] = {"arms": verdicts,
                              "met": all(v for a, v in verdicts.items() if a in SPECULATIVE) if verdicts else None}
        if "lossy" in verdicts:  # the plant: a test that cannot reject it cannot vouch for the other arms
            out["rl_lossless"]["planted_lossy_caught"] = not verdicts["lossy"]
    return out


def build_report(runs: list[dict], window: int = 5, switch_at: int | None = None) -> dict:
    """The report of finished runs (each ``run_arm``'s JSON)."""
    by_arm: dict[str, list[dict]] = {}
    for r in runs:
        by_arm.setdefault(r["arm"], []).append(r)
    arms: dict[str, dict] = {}
    for arm, rs in by_arm.items():
        a = {key: per_step(rs, key) for key in ("mean_reward", "kl_from_start", "acceptance_length",
                                                "generation_ms_per_token", "mean_completion_tokens",
                                                "draft_version", "trainer_cpu_s")}
        a["first_position_acceptance"] = [mean([(r["steps"][i]["per_position_acceptance"] or [None])[0] for r in rs])
                                          for i in range(len(a["mean_reward"]))]
        a["seeds"] = [r["seed"] for r in rs]
        a["windows"] = window_bounds(len(a["mean_reward"]), window, switch_at)
        a["window_acceptance_length"] = window_means(a["acceptance_length"], window, switch_at)
        a["window_first_position_acceptance"] = window_means(a["first_position_acceptance"], window, switch_at)
        a["window_reward"] = window_means(a["mean_reward"], window, switch_at)
        a["window_kl_from_start"] = window_means(a["kl_from_start"], window, switch_at)
        a["logprob_check"] = logprob_check(rs)
        a["final_drafts_eval"] = final_eval(rs)
        a["publishes"] = [sum(1 for v in (r["publish_gate"] or []) if v.get("publish")) for r in rs]
        a["gate_verdicts"] = [len(r["publish_gate"] or []) for r in rs]
        if (arm in SPECULATIVE or arm.startswith("online")) and switch_at is not None:
            a["recovery"] = recovery(a["acceptance_length"], a["trainer_cpu_s"], switch_at, window)
        arms[arm] = a
    if "plain" in arms:  # generation time per token against plain's, same seeds and steps
        for arm, a in arms.items():
            a["ms_per_token_vs_plain"] = (mean(a["generation_ms_per_token"])
                                          / mean(arms["plain"]["generation_ms_per_token"]))
    if "frozen" in arms and "online" in arms:
        arms["online"]["ms_per_token_vs_frozen"] = (mean(arms["online"]["generation_ms_per_token"])
                                                   / mean(arms["frozen"]["generation_ms_per_token"]))
    lossless = lossless_test(by_arm, window, switch_at)
    return {"benchmark": "rl_staleness", "window": window, "switch_at": switch_at,
            "host": runs[0]["host"] if runs else None, "settings": runs[0]["settings"] if runs else None,
            "arms": arms, "lossless": lossless, "goals": goals(arms, window, switch_at, lossless), "runs": runs}


def plot(report: dict, png: Path) -> None:
    """Acceptance length, reward and KL from the start by step, one line per arm (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), layout="constrained")
    panels = (("acceptance_length", "served acceptance length (k fixed)"), ("mean_reward", "mean reward"),
              ("kl_from_start", "KL(policy || start), held-out"))
    for ax, (key, title) in zip(axes, panels):
        for arm, a in report["arms"].items():
            ys = a[key]
            if all(y is None for y in ys):
                continue
            ax.plot(range(len(ys)), [math.nan if y is None else y for y in ys], marker=".", label=arm)
        if report["switch_at"] is not None:
            ax.axvline(report["switch_at"] - 0.5, color="grey", linestyle="--", label="task switch")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(fontsize=8)
    host = report.get("host") or {}
    fig.suptitle(f"rl_run: {', '.join(report['arms'])}; {host.get('cpu_model', '?')}", fontsize=10)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def print_summary(report: dict) -> None:
    """Per window: each arm's acceptance length, reward, KL; then the goals."""
    for arm, a in report["arms"].items():
        print(f"{arm:13s} seeds {a['seeds']}: "
              + " | ".join(f"steps {lo}-{hi - 1}: reward {r:.2f}, KL {k:.3f}"
                           + (f", AL {al:.2f}" if al is not None else "")
                           for (lo, hi), r, k, al in zip(a["windows"], a["window_reward"], a["window_kl_from_start"],
                                                         a["window_acceptance_length"])))
    for arm, a in report["arms"].items():
        if a.get("final_drafts_eval"):
            f = a["final_drafts_eval"]
            print(f"{arm}: on its final policy, the draft it ended with serves AL {f['ended_with']:.2f}, "
                  f"the starting draft {f['starting']:.2f}")
    for arm, v in (report["lossless"].get("arms") or {}).items():
        print(f"{arm}: RL-level test against plain: " + (
            v["why"] if not v["tested"] else
            f"{'agrees' if v['agrees_with_plain'] else 'differs on ' + ', '.join(v['rejected_on'])} "
            f"(smallest p {v['min_p']:.2g} over {len(v['buckets'])} tests)"))
    print(json.dumps(report["goals"], indent=1))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*_s*.json")) if "partial" not in p.name]
    old = json.loads((out / "rl_run.json").read_text()) if (out / "rl_run.json").exists() else {}
    report = build_report(runs, old.get("window", 5), old.get("switch_at"))
    plot(report, out / "rl_run.png")
    (out / "rl_run.json").write_text(json.dumps(report, indent=1))
    print_summary(report)
