"""The RL demo's report: each run's steps summarized, ratios against plain (raw, per token, at the same
lengths), the table it prints and the plot it writes (``scripts/rl_demo.py``)."""

from __future__ import annotations

from pathlib import Path

STAGES = ("exposed_generation_s", "logprob_s", "training_s", "sync_s")
PROPOSERS = ("spec", "history", "mtp")  # the runs compared against plain


def summarize(runs: dict) -> dict:
    """Mean stage times per run, ratios against the matching plain run, reward agreement."""
    summary: dict = {}
    for mode, r in runs.items():
        steps = r["steps"]
        mean = lambda k: sum(s[k] for s in steps) / len(steps)  # noqa: E731
        rewards = [x for s in steps for x in s["rewards"]]
        p = sum(rewards) / len(rewards)
        accepted = [s["acceptance_length"] for s in steps if s["acceptance_length"]]
        on_policy = [s["on_policy_logprob_abs_diff_max"] for s in steps
                     if s["on_policy_logprob_abs_diff_max"] is not None]
        ks = [s["mean_k"] for s in steps if s.get("mean_k") is not None]
        summary[mode] = {**{k: mean(k) for k in ("generation_s", "generation_bulk_s", "generation_tail_s",
                                                 *STAGES, "step_s", "tokens")},
                         "mean_k": sum(ks) / len(ks) if ks else None,
                         "mean_reward": p, "reward_se": (p * (1 - p) / len(rewards)) ** 0.5,
                         "rollouts": sum(s["rollouts"] for s in steps),
                         "acceptance_length_first": accepted[0] if accepted else None,
                         "acceptance_length_last": accepted[-1] if accepted else None,
                         "logprob_abs_diff_max": max(s["logprob_abs_diff_max"] for s in steps),
                         "logprob_abs_diff_mean": sum(s["logprob_abs_diff_mean"] * s["tokens"] for s in steps)
                         / max(1, sum(s["tokens"] for s in steps)),
                         "on_policy_logprob_abs_diff_max": max(on_policy) if on_policy else None}
    comparisons = {}
    for mode in runs:
        # Against the same schedule without speculation, else against plain sync (async + spec stacked).
        proposer = mode.split("-")[0]
        base = mode.replace(proposer, "plain") if mode.replace(proposer, "plain") in runs else "plain"
        if proposer in PROPOSERS and base in runs:
            a, b = summary[mode], summary[base]
            se = (a["reward_se"] ** 2 + b["reward_se"] ** 2) ** 0.5
            z = (a["mean_reward"] - b["mean_reward"]) / se if se > 0 else 0.0
            comparisons[f"{mode}_vs_{base}"] = {
                "step_time": a["step_s"] / b["step_s"], "rollout_time": a["generation_s"] / b["generation_s"],
                "rollout_bulk_time": a["generation_bulk_s"] / b["generation_bulk_s"],
                "rollout_tail_time": a["generation_tail_s"] / max(b["generation_tail_s"], 1e-9),
                # The runs sample different tokens (same distribution, other random draws), so their
                # answers' lengths differ: generation time per generated token compares like with like.
                "rollout_time_per_token": (a["generation_s"] / a["tokens"]) / (b["generation_s"] / b["tokens"]),
                "reward_difference": a["mean_reward"] - b["mean_reward"], "reward_z": z,
                "rewards_agree_within_noise": abs(z) < 3,
                **same_length_ratios(runs, mode, base)}
    for mode in runs:
        if mode.endswith("-async") and mode.removesuffix("-async") in runs:
            comparisons[f"{mode}_vs_{mode.removesuffix('-async')}"] = {
                "step_time": summary[mode]["step_s"] / summary[mode.removesuffix("-async")]["step_s"]}
    summary["comparisons"] = comparisons
    return summary


def same_length_ratios(runs: dict, mode: str, base: str) -> dict:
    """``mode``'s generation time over ``base``'s engine's time for the very same answer lengths
    (``replay_lengths``), and the check on the replay: ``base``'s replay of its own lengths over
    the time its loop measured for them (1.0 when a replay costs what the loop's rollouts cost), and
    the first adjusted by the second.

    For a synchronous run also its step time over the same steps with ``base``'s generation in
    place of its own: the policy phases (log-probs, update, sync) are the same code on the same
    samples whichever engine sampled them, so at identical lengths they cost what ``mode``'s did."""
    replays = runs[base].get("length_replays", {})
    if mode not in replays or base not in replays:
        return {}
    steps = {(m, s["step"]): s for m in (mode, base) for s in runs[m]["steps"]}
    total = lambda m, recs, key="generation_s": sum(steps[(m, r["step"])][key] for r in recs)  # noqa: E731
    replayed = lambda m: sum(r["generation_s"] for r in replays[m])  # noqa: E731
    out = {"rollout_time_same_lengths": total(mode, replays[mode]) / replayed(mode),
           "base_replay_over_its_loop": replayed(base) / total(base, replays[base])}
    # A replay is not quite a loop (one ignore_eos request per answer, not one n = G request per
    # prompt; a little faster than the loop at plain's own lengths), so it flatters ``base``
    # by that factor (``base_replay_over_its_loop``, measured in every run): ``mode``'s loop against
    # ``base``'s loop estimated at ``mode``'s lengths.
    out["rollout_time_same_lengths_loop_adjusted"] = (out["rollout_time_same_lengths"]
                                                      * out["base_replay_over_its_loop"])
    if all("bulk_s" in r for r in replays[mode]):
        # The same split of the same answers (``rl.rollouts.bulk_and_tail``): where the two engines
        # part, with the chance of which answers ran long taken out.
        for part in ("bulk", "tail"):
            replayed_part = sum(r[f"{part}_s"] for r in replays[mode])
            if replayed_part > 0:
                out[f"rollout_{part}_time_same_lengths"] = (
                    total(mode, replays[mode], f"generation_{part}_s") / replayed_part)
    if not mode.endswith("-async"):
        step_s = total(mode, replays[mode], "step_s")
        out["step_time_same_lengths"] = step_s / (step_s - total(mode, replays[mode], "exposed_generation_s")
                                                  + replayed(mode))
    return out


def step_costs(calibration: dict | None) -> dict[str, list[float]]:
    """From the run's start-up calibration: per batch-size bucket, each k's step cost in k = 0 (plain) steps."""
    out = {}
    for bucket, b in ((calibration or {}).get("buckets") or {}).items():
        rel = b.get("step_time_vs_served") or []
        if b.get("swept") and rel and rel[0] > 0:
            out[bucket] = [x / rel[0] for x in rel]
    return out


def verdict(report: dict, mode: str = "spec") -> str | None:
    """Whether this run's speculation paid, and where it would, in a sentence from what the run measured:
    the acceptance length it served and its calibration's step costs at the smallest and the largest batch."""
    run_, summary = report["runs"].get(mode), report.get("summary", {})
    comparison = summary.get("comparisons", {}).get(f"{mode}_vs_plain")
    costs = step_costs((run_ or {}).get("calibration"))
    accepted = [x for s in (run_ or {}).get("steps", []) for x in [s.get("acceptance_length")] if x]
    if not (run_ and comparison and costs and accepted):
        return None
    al = sum(accepted) / len(accepted)
    buckets = sorted(costs, key=lambda b: int(b.split("-")[0]))
    small, large = buckets[0], buckets[-1]
    k = len(costs[large]) - 1

    def sequences(bucket: str) -> str:
        lo, hi = bucket.split("-")
        return f"{lo} sequence{'s' if hi != '1' else ''}" if lo == hi else f"{lo}-{hi} sequences"

    def pays(bucket: str) -> str:
        cost = costs[bucket][k]
        return f"a k = {k} step costs {cost:.2f} plain steps, so AL {al:.2f} gives ~{al / cost:.2f}x"

    per_token = comparison["rollout_time_per_token"]
    outcome = "paid" if per_token < 0.97 else "did not pay" if per_token > 1.03 else "broke even"
    return (f"Speculation {outcome} here (time per token {per_token:.2f} of plain's, acceptance length {al:.2f} served "
            f"at mean k {summary[mode].get('mean_k') or 0:.2f}). This machine's calibration: at {sequences(large)} "
            f"(this demo's bulk) {pays(large)}; at {sequences(small)} {pays(small)}. On a GPU a verify step costs "
            "little more than a plain one while decode is memory-bound, so the same acceptance pays at larger "
            "batches there.")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = report["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), layout="constrained")
    for mode, run_ in runs.items():
        xs = [s["step"] for s in run_["steps"]]
        axes[0].plot(xs, [s["mean_reward"] for s in run_["steps"]], marker="o", label=mode)
        if mode.startswith(PROPOSERS):
            axes[1].plot(xs, [s["acceptance_length"] or float("nan") for s in run_["steps"]], marker="o", label=mode)
    axes[0].set_title("mean reward per step", fontsize=10)
    axes[1].set_title("served acceptance length per step", fontsize=10)
    for ax in axes[:2]:
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    modes = list(runs)
    bottoms = [0.0] * len(modes)
    for stage in STAGES:
        vals = [report["summary"][m][stage] for m in modes]
        axes[2].bar(modes, vals, bottom=bottoms, label=stage.removesuffix("_s"))
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    axes[2].scatter(modes, [report["summary"][m]["step_s"] for m in modes], color="k", marker="_", s=400,
                    label="wall step time", zorder=3)
    axes[2].set_title("mean step time (s) by phase", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend()
    axes[1].legend()
    axes[2].legend(fontsize=8)
    fig.savefig(path, dpi=110)


def print_table(report: dict) -> None:
    summary = report["summary"]
    print("\nrun          gen_s exposed  logp_s train_s  sync_s  step_s  reward  accept(first->last)  "
          "|dlogp| mean/max  on-policy max  mean k")
    for mode in report["runs"]:
        s = summary[mode]
        acc = (f"{s['acceptance_length_first']:.2f}->{s['acceptance_length_last']:.2f}"
               if s["acceptance_length_first"] else "-")
        onp = f"{s['on_policy_logprob_abs_diff_max']:.3f}" if s["on_policy_logprob_abs_diff_max"] is not None else "-"
        print(f"{mode:11s} {s['generation_s']:6.1f} {s['exposed_generation_s']:7.1f} {s['logprob_s']:7.1f} "
              f"{s['training_s']:7.1f} {s['sync_s']:7.1f} {s['step_s']:7.1f} {s['mean_reward']:7.2f}  "
              f"{acc:>19s}  {s['logprob_abs_diff_mean']:.4f}/{s['logprob_abs_diff_max']:.3f} {onp:>14s}"
              + (f"  {s['mean_k']:.2f}" if s["mean_k"] is not None else "       -"))
    for name, c in summary["comparisons"].items():
        extra = (f", rollout time {c['rollout_time']:.2f} (per token {c['rollout_time_per_token']:.2f}; "
                 f"bulk {c['rollout_bulk_time']:.2f}, "
                 f"tail {c['rollout_tail_time']:.2f}"
                 + (f"; against plain at the same lengths {c['rollout_time_same_lengths']:.2f}"
                    + (f" (step time {c['step_time_same_lengths']:.2f})" if "step_time_same_lengths" in c else "")
                    + (f", bulk {c['rollout_bulk_time_same_lengths']:.2f}, "
                       f"tail {c['rollout_tail_time_same_lengths']:.2f}"
                       if "rollout_tail_time_same_lengths" in c else "")
                    + f", plain's replay of its own {c['base_replay_over_its_loop']:.2f} of its loop's time"
                    + f", adjusted for that {c['rollout_time_same_lengths_loop_adjusted']:.2f}"
                    if "rollout_time_same_lengths" in c else "")
                 + f"), reward diff {c['reward_difference']:+.3f} "
                 f"(z {c['reward_z']:+.2f}, {'agree' if c['rewards_agree_within_noise'] else 'DISAGREE'})"
                 if "rollout_time" in c else "")
        print(f"{name}: step time {c['step_time']:.2f}{extra}")
    sentence = verdict(report)
    if sentence:
        print(sentence)
