"""The step order of a GRPO job on a speculative engine, as one object.

A step: the draft trainer resumes; G samples per prompt at T = 1 with the policy versions each was
sampled under; the trainer pauses (the policy phases get the cores); logprob recomputation and one
GRPO update; the new weights published in place as the next policy version (``EngineClient.update_policy``:
validated, atomic, prefix cache reset); vLLM's speculative-decoding counters over the step's rollouts.
With ``policy_lag=1`` the next step's rollouts run while this step trains, and the update lands in
flight (``pause="keep"``): a rollout may span two versions, which its samples record and the clipped
importance ratio corrects.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_specrl import metrics
from vllm_specrl._log import logger
from vllm_specrl.rl.draft_trainer import DraftTrainerProcess
from vllm_specrl.rl.policy import Policy
from vllm_specrl.rl.rollouts import check_rollouts, sample_groups

Task = tuple[str, Any]  # (prompt, what the reward compares the answer with)


def rollout_seed(seed: int, step: int, requests: int) -> int:
    """The seed of step ``step``'s first sample: ``sample_groups`` seeds every sample apart, so the
    steps' seeds are ``requests`` (prompts x G) apart and no two samples of a run share a stream."""
    return (seed * 7919 + step) * requests


@dataclass
class StepResult:
    """What one step did; ``status`` is ``/specrl/status`` after its rollouts arrived."""

    step: int
    samples: list[dict]
    generation: dict              # generation_s, bulk_s, tail_s of the step's rollouts
    exposed_generation_s: float   # what the loop waited for them (less than generation_s with lag 1)
    logprobs: list[torch.Tensor]  # the trainer's recomputed logprobs of every sample, detached
    loss: float
    logprob_s: float
    training_s: float
    sync_s: float
    step_s: float
    trained_version: int          # the policy version the gradient was taken at
    served: dict                  # vLLM's spec-decode counters over the rollouts (metrics.summary_delta)
    status_before: dict
    status: dict

    @property
    def on_policy(self) -> list[bool]:
        """Per sample: sampled entirely by the version the gradient was taken at (its logprobs must
        then match the trainer's up to numerics)."""
        return [s["policy_version_start"] == s["policy_version_end"] == self.trained_version for s in self.samples]

    def logprob_abs_diff(self) -> list[torch.Tensor]:
        """Per sample, |trainer's logprob - vLLM's| per token: lossless in the RL sense."""
        return [(lp - torch.tensor(s["vllm_logprobs"])).abs() for lp, s in zip(self.logprobs, self.samples)]

    def on_policy_logprob_abs_diff(self) -> list[torch.Tensor]:
        """``logprob_abs_diff`` of the on-policy samples alone (only they can match exactly)."""
        return [d for d, on in zip(self.logprob_abs_diff(), self.on_policy) if on]


class GRPOLoop:
    """Steps of GRPO against a served engine: ``for i in range(steps): loop.step(i)``.

    ``tasks(i)`` gives step i's (prompt, answer) pairs, ``reward(text, answer)`` scores a completion.
    ``draft_trainer``: an online draft trainer to pause for the policy phases (``yields``, not with lag);
    with ``trainer_trains_during="policy"`` it trains only while the step's policy phases run and is paused
    from the step's end through the next rollouts (generation then shares its cores with capture alone,
    and nothing else run between steps, another engine's turn, shares them with its training).
    ``mtp_head``: for an MTP policy with an online trainer, the directory ``Policy.write_head`` keeps
    current for it; the update then sends the body alone (``keep_mtp``), the served MTP layer being
    the trainer's."""

    def __init__(self, engine: Any, model: str, policy: Policy, tasks: Callable[[int], Sequence[Task]],
                 reward: Callable[[str, Any], float], *, steps: int, group: int = 4, max_tokens: int = 256,
                 clip: float = 0.2, seed: int = 0, policy_lag: int = 0,
                 draft_trainer: DraftTrainerProcess | None = None, trainer_yields: bool = True,
                 trainer_trains_during: str = "rollouts", keep_mtp: bool = False, mtp_head: Path | None = None,
                 checkpoint_dir: Path | None = None, temperature: float = 1.0):
        if policy_lag not in (0, 1):
            raise ValueError("policy_lag is 0 (synchronous) or 1 (the next rollouts run while a step trains)")
        if trainer_trains_during not in ("rollouts", "policy"):
            raise ValueError("trainer_trains_during is 'rollouts' or 'policy'")
        if trainer_trains_during == "policy" and policy_lag:
            raise ValueError("with policy_lag=1 rollouts run during the policy phases: the trainer trains "
                             "during the rollouts")
        if mtp_head is not None and checkpoint_dir is None:
            raise ValueError("mtp_head needs checkpoint_dir (the policy's config is copied from it)")
        self.engine, self.model, self.policy = engine, model, policy
        self.tasks, self.reward = tasks, reward
        self.steps, self.group, self.max_tokens, self.clip, self.seed = steps, group, max_tokens, clip, seed
        self.policy_lag, self.draft_trainer = policy_lag, draft_trainer
        self.trainer_yields = trainer_yields and policy_lag == 0
        self.trainer_trains_during = trainer_trains_during
        self.keep_mtp, self.mtp_head, self.checkpoint_dir = keep_mtp, mtp_head, checkpoint_dir
        self.temperature = temperature  # the rollouts' (1 in RL; other values only to plant a lossy arm)
        self._pool = ThreadPoolExecutor(1)
        self._pending: Future | None = None
        self._before: dict | None = None

    def rollouts(self, i: int) -> tuple[list[dict], dict]:
        """Step i's G samples per task, scored: (samples, timing)."""
        tasks = list(self.tasks(i))
        return sample_groups(self.engine.url, self.model, [self.policy.chat(p) for p, _ in tasks], self.group,
                             self.max_tokens, rollout_seed(self.seed, i, len(tasks) * self.group), i,
                             lambda j, text: self.reward(text, tasks[j][1]), temperature=self.temperature)

    def step(self, i: int) -> StepResult:
        """Step i (0-based, in order): leaves policy version ``policy.version + 1`` serving."""
        if self._before is None:
            self._before = self.engine.status()
            if self.policy_lag:
                self._pending = self._pool.submit(self.rollouts, i)
        if self.draft_trainer is not None:
            if self.trainer_trains_during == "rollouts":
                self.draft_trainer.resume()  # it trains while rollouts run
            else:
                self.draft_trainer.pause()  # (a trainer starts unpaused) it only ingests the rollouts
        t_step = time.perf_counter()
        if self.policy_lag:
            samples, timing = self._pending.result()
            self._pending = self._pool.submit(self.rollouts, i + 1) if i + 1 < self.steps else None
        else:
            samples, timing = self.rollouts(i)
        exposed = time.perf_counter() - t_step
        status = self.engine.status()
        check_rollouts(samples, i, len(samples) // self.group, self.group)
        if self.draft_trainer is not None and self.trainer_trains_during == "policy":
            self.draft_trainer.resume()  # it ingested the rollouts' frames; it trains until the step ends
        elif self.draft_trainer is not None and self.trainer_yields:
            self.draft_trainer.pause()  # resumed before the next rollouts
        trained_version = self.policy.version
        logps, loss, logprob_s, training_s = self.policy.grpo_pass(samples, self.group, self.clip)
        t0 = time.perf_counter()
        if self.mtp_head is not None:
            self.policy.write_head(self.checkpoint_dir, self.mtp_head)  # before the commit the trainer sees
        self.engine.update_policy(self.policy.model.named_parameters(), version=trained_version + 1,
                                  pause="keep" if self.policy_lag else "wait", keep_mtp=self.keep_mtp)
        self.policy.version = trained_version + 1
        sync_s = time.perf_counter() - t0
        if self.draft_trainer is not None and self.trainer_trains_during == "policy":
            self.draft_trainer.pause()  # its training ends with the step's policy phases
        served = metrics.summary_delta(self._before["spec_decode"], status["spec_decode"])
        result = StepResult(i, samples, timing, exposed, logps, loss, logprob_s, training_s, sync_s,
                            time.perf_counter() - t_step, trained_version, served, self._before, status)
        self._before = status
        self.report_logprobs(result)
        return result

    def report_logprobs(self, result: StepResult) -> dict | None:
        """The step's |trainer logprob - served logprob| over its on-policy tokens, sent to the engine's
        status and metrics (an alert on it catches a logprob path gone lossy); None without such tokens."""
        diffs = result.on_policy_logprob_abs_diff() if result.logprobs else []
        if not diffs or not sum(d.numel() for d in diffs):
            return None
        flat = torch.cat([d.reshape(-1) for d in diffs])
        report = {"step": result.step, "policy_version": result.trained_version, "tokens": int(flat.numel()),
                  "samples": len(diffs), "max": float(flat.max()), "mean": float(flat.mean())}
        report_to = getattr(self.engine, "report_logprobs", None)
        if callable(report_to):
            try:
                report_to(report)
            except Exception as exc:  # noqa: BLE001 - a report never stops training
                logger.debug("logprob report not sent: %r", exc)
        return report

    def close(self) -> None:
        """Drops a queued next step's rollouts (lag 1 past the last step is never queued)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "GRPOLoop":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
