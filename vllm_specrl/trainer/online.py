"""Online draft trainer: learn from the hidden states vLLM streams out while RL runs.

    vllm-specrl train-draft --capture tcp://127.0.0.1:5557 --engine http://127.0.0.1:8000 \\
        --draft /ckpt/draft --target /ckpt/policy

Receives capture frames (``vllm_specrl.capture``), assembles each request's
committed rows into a training sequence once the request has been quiet for
``--idle-s``, keeps a bounded replay buffer of recent sequences, and runs the
shared training core on completion positions only (soft targets from the
engine's top-K logprobs when the engine captures them, ``capture_topk``;
otherwise from the captured final hidden state through the target's LM
head). Every ``--publish-every`` steps it pushes the
draft into the engine in place (``EngineClient.update_draft``) if the publish
gate (``trainer.publish_gate``) finds it ahead of the served draft on held-out
rollouts (every ``--holdout-every``-th one is never trained on); every
``--checkpoint-every`` steps it saves a resumable checkpoint, from which it
restarts. When frames carry a new policy version it drops older sequences
(and, without top-K targets, reloads the LM head and embedding from
``--target``).
The engine never waits for it: if the trainer is slow or gone, the engine
drops frames; if the engine is gone, publishing fails, is logged, and is
retried at the next publish. An engine that restarted serves the draft on disk
again: the next publish, or while the trainer rests (no publish comes until
the policy moves) a check every ``lost_draft_check_s``, gives it the draft the
trainer last published.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from vllm_specrl.capture.receiver import CaptureReceiver, SequenceAssembler
from vllm_specrl.proposer.checkpoint import load_draft, target_lm_head
from vllm_specrl.sync.clients.response_check import EngineKeyRefused
from vllm_specrl.sync.clients.engine_client import WeightSyncError
from vllm_specrl.trainer.core import TRAINER_STATE, DraftTrainer, TrainConfig
from vllm_specrl.trainer.mtp import MTPTrainer
from vllm_specrl.trainer.publish_gate import GateConfig, PublishGate


def served_draft_versions(statuses: dict[str, tuple[bool, Any]]) -> list[int]:
    """The draft version each reachable replica serves (``FleetClient.statuses()``)."""
    return [status["versions"]["draft"] for ok, status in statuses.values() if ok]


@dataclass
class OnlineConfig:
    capture: str = "tcp://127.0.0.1:5557"
    capture_allow_remote: bool = False  # bind a non-loopback address (engines on other hosts)
    engine: str | None = None
    api_key: str | None = None
    batch_size: int = 8
    min_sequences: int = 4
    buffer_sequences: int = 512
    max_len: int = 512
    idle_s: float = 1.0
    publish_every: int = 20
    checkpoint_every: int = 50
    max_steps: int | None = None
    max_seconds: float | None = None
    seed: int = 0
    # Samples trained per captured sequence before idling; None trains continuously. On hardware the
    # trainer shares with the engine and the RL loop (a CPU box), a cap keeps it from taking cycles
    # that rollouts and the policy update need.
    replay_ratio: float | None = None
    # Publish gate (``trainer.publish_gate``): every n-th captured rollout is held out of training, and
    # a draft is published only if its estimate on the held-out rollouts beats the served draft's by
    # more than ``publish_margin``. 0 publishes every ``publish_every`` steps unconditionally.
    holdout_every: int = 4
    holdout_sequences: int = 32
    holdout_min: int = 4
    publish_margin: float = 0.0
    # When the gate holds a candidate as no better than the served draft, go back to the served
    # draft's weights (fresh optimizer state) and rest, ingesting only, until the next policy version:
    # in `make demo` every candidate of a policy version was held (the warm start was not beaten on
    # the next rollouts), and training on regardless took the rollouts' cores while drifting further
    # from the draft being served.
    rest_after_hold: bool = True
    # A rest also ends once this many rollouts have been ingested since it began (0: only a new policy
    # version ends it). Without it, an engine serving between policy updates, or with none at all,
    # kept the draft of the first "not better" verdict for good: one noisy verdict on a few held-out
    # rollouts stopped the trainer for the rest of the run. Enough fresh rollouts are fresh evidence
    # (and refresh most of the held-out set), so the trainer tries again from the served weights.
    rest_sequences: int = 32
    # Back off: each hold in a row (no publish between them) doubles what the next rest spans, up to
    # this many policy versions (and as many times ``rest_sequences``); a published draft resets it
    # (1: every new policy version ends a rest). On shared cores a trainer that cannot beat the served
    # draft, because the policy barely moved, took generation time for nothing;
    # backing off keeps that cost to one version in ``rest_backoff_max`` while a policy that drifts,
    # and so lets candidates win again, is followed every version.
    rest_backoff_max: int = 8
    # Policy versions whose captured rollouts stay in the replay buffer (1: the current version's alone).
    # RL moves the policy a little each step, so the last few versions' rollouts are nearly on-policy
    # data: keeping them gives the draft several versions' worth of sequences to learn a drift from,
    # where the current version alone is one step's rollouts (a few dozen), replayed until they overfit.
    keep_versions: int = 1
    # While resting, how often to ask the replicas whether one restarted and lost the published draft.
    lost_draft_check_s: float = 5.0
    # While this file exists the trainer ingests frames but neither trains nor publishes: an RL loop
    # that shares the machine with it creates the file for its own policy phases (logprobs, update).
    pause_file: str | None = None
    # "eagle3": train the EAGLE-3 draft at --draft; "mtp": train the policy's own MTP layer, starting
    # from the one in --draft (the policy checkpoint), on an engine serving "method": "mtp".
    drafter: str = "eagle3"


class OnlineDraftTrainer:
    def __init__(self, draft_dir: Path | str, target_dir: Path | str, cfg: OnlineConfig,
                 train_cfg: TrainConfig | None = None, checkpoint_dir: Path | str | None = None,
                 log_path: Path | str | None = None):
        self.cfg = cfg
        self.target_dir = Path(target_dir)
        self.checkpoint_dir = Path(checkpoint_dir or Path(draft_dir).with_name(Path(draft_dir).name + "-online"))
        resume = (self.checkpoint_dir / TRAINER_STATE).exists()
        source = self.checkpoint_dir if resume else Path(draft_dir)
        if cfg.drafter == "mtp":
            self.trainer = (MTPTrainer.from_checkpoint(source, self.target_dir, train_cfg) if resume
                            else MTPTrainer(self.target_dir, train_cfg, start_from=source))
        elif cfg.drafter != "eagle3":
            raise ValueError(f"drafter must be 'eagle3' or 'mtp', not {cfg.drafter!r}")
        elif resume:
            self.trainer = DraftTrainer.from_checkpoint(source, self.target_dir, train_cfg)
        else:
            self.trainer = DraftTrainer(load_draft(source, self.target_dir), target_lm_head(self.target_dir),
                                        train_cfg)
        self.resumed_from_step = self.trainer.step_count if resume else None
        self.rng = random.Random(cfg.seed)
        # Received in a thread of its own: frames keep arriving while a training step runs.
        self.receiver = CaptureReceiver(cfg.capture, allow_remote=cfg.capture_allow_remote, background=True)
        self.assembler = SequenceAssembler()
        self.last_seen: dict[str, float] = {}
        self.buffer: deque = deque(maxlen=cfg.buffer_sequences)
        self.ingested = 0
        self.stop_requested = threading.Event()  # set by a signal handler: the loop ends cleanly
        self.drops: Counter[str] = Counter()
        self.partial = 0
        self.prefix_cached = 0
        self.trained_samples = 0
        # The replay budget counts the current policy version only: a budget left over from the last
        # version (rollouts that finished while training was paused) must not be spent replaying the
        # new version's first few rollouts over and over.
        self.version_buffered = 0
        self.version_trained = 0
        self.gate = PublishGate(self.trainer, GateConfig(every=cfg.holdout_every, capacity=cfg.holdout_sequences,
                                                         min_sequences=cfg.holdout_min, margin=cfg.publish_margin))
        self.policy_version: int | None = None
        self.resting_version: int | None = None  # policy version the trainer rests through (rest_after_hold)
        self.rest_began_at = 0  # ``ingested`` when the current rest began (rest_sequences ends it)
        self.rests = 0
        self.holds_in_a_row = 0  # rests since the last publish: the current rest spans 2**(n-1) versions
        self.topk_targets = False  # whether captured sequences carry the engine's top-K logprobs
        self.draft_version = 0
        self.publish_errors = 0
        self.next_lost_draft_check = 0.0  # time.monotonic() of the next check while resting
        self.client = None
        if cfg.engine:  # one URL, or several (comma-separated): every replica gets each draft
            from vllm_specrl.sync.clients.fleet import FleetClient

            self.client = FleetClient(cfg.engine.split(","), api_key=cfg.api_key, timeout=120)
            self.client.statuses()  # a refused API key stops the trainer here (EngineKeyRefused), not silently later
        self.log = open(log_path, "a") if log_path else None  # noqa: SIM115 - closed in close()

    # -- data ------------------------------------------------------------------------------
    def pump(self, timeout_ms: int = 100) -> int:
        """Receive frames; move quiet requests into the replay buffer. Returns frames received."""
        frames = self.receiver.receive(timeout_ms)
        now = time.time()
        for header, tensors in frames:
            self.assembler.add(header, tensors)
            self.last_seen[header["request_id"]] = now
            version = header.get("policy_version")
            if version is not None and version != self.policy_version:
                self.on_policy_version(version)
        for rid in [r for r, t in self.last_seen.items() if now - t >= self.cfg.idle_s]:
            del self.last_seen[rid]
            self.ingest(rid)
        return len(frames)

    def ingest(self, request_id: str) -> bool:
        """Move a finished request's trainable rows into the replay buffer, or count why not.

        Kept: the rows generated under the current policy version (a request that spans a
        commit keeps its newer rows), from the first captured position (GRPO siblings and
        repeated prompts start after their cached prefix). Every request lands in exactly
        one of ``ingested`` or a ``drops`` reason; ``partial`` counts kept requests that lost
        rows to another version and ``prefix_cached`` those that started after position 0.
        """
        request = self.assembler.requests[request_id]
        total_rows = len(request.rows)
        seq = self.assembler.pop(request_id, version=self.policy_version)
        kept = len(seq["token_ids"])
        # Only sequences with completion rows teach the draft anything vLLM will ask of it.
        drafted = kept - seq["first_draft"] - 1
        if request.drafter != self.trainer.drafter:
            reason = "other_drafter"  # an engine that drafts with something this trainer does not train
        elif kept == 0:
            reason = "no_rows" if total_rows == 0 else "other_policy_version"
        elif drafted < 2:
            reason = "too_few_completion_rows"
        else:
            reason = None
        if reason is not None:
            self.drops[reason] += 1
            return False
        self.partial += int(kept < total_rows)
        self.prefix_cached += int(seq["start"] > 0)
        seq = {k: v[: self.cfg.max_len] if torch.is_tensor(v) else v for k, v in seq.items()}
        self.ingested += 1
        self.topk_targets = "topk_logprobs" in seq
        if not self.gate.take(seq, self.policy_version):
            self.buffer.append({**seq, "policy_version": self.policy_version})
            self.version_buffered += 1
        return True

    def capture_counts(self) -> dict[str, Any]:
        """What happened to every captured request (the trainer log's ``capture`` field)."""
        return {"ingested": self.ingested, "drops": dict(self.drops), "partial": self.partial,
                "prefix_cached": self.prefix_cached, "frames": dict(self.receiver.counters)}

    def on_policy_version(self, version: int) -> None:
        """The policy moved: drop the old policy's sequences.

        With ``capture_topk`` the soft targets travel in the frames (the engine's own logits
        for the version that generated them), so nothing is read from disk and nothing can be
        stale. Without it they come from the target's LM head, re-read from ``--target``, which
        the RL loop must have written before the commit.
        """
        first = self.policy_version is None
        self.policy_version = version
        if first:
            return
        keep = [seq for seq in self.buffer
                if seq.get("policy_version") is not None and version - seq["policy_version"] < self.cfg.keep_versions]
        self.buffer.clear()
        self.buffer.extend(keep)
        self.version_buffered = self.version_trained = 0
        self.gate.on_policy_version(version)
        if self.topk_targets and self.trainer.drafter == "eagle3":
            return  # (the MTP trainer's targets always come from the head and norm: it re-reads them)
        self.trainer.refresh_target(self.target_dir)

    # -- training ----------------------------------------------------------------------------
    def paused(self) -> bool:
        return self.cfg.pause_file is not None and os.path.exists(self.cfg.pause_file)

    def rest_span(self) -> int:
        """Policy versions the current rest spans: 1, 2, 4, ... for each hold in a row, at most
        ``rest_backoff_max``."""
        return min(2 ** max(self.holds_in_a_row - 1, 0), max(self.cfg.rest_backoff_max, 1))

    def resting(self) -> bool:
        """Resting after a held candidate: until the policy has moved ``rest_span()`` versions, or
        ``rest_sequences`` x that many new rollouts came."""
        if self.resting_version is None or self.policy_version is None:
            return False
        span = self.rest_span()
        if not self.resting_version <= self.policy_version < self.resting_version + span:
            return False
        fresh = self.ingested - self.rest_began_at
        return not (self.cfg.rest_sequences and fresh >= self.cfg.rest_sequences * span)

    def rest(self) -> None:
        """Drop the held candidate: the served draft's weights, a fresh optimizer, no training until the
        policy moves ``rest_span()`` versions (``on_policy_version`` changes ``policy_version``) or
        ``rest_sequences`` x that many new rollouts have been ingested."""
        self.gate.revert()
        self.trainer.optimizer.state.clear()
        self.resting_version = self.policy_version
        self.rest_began_at = self.ingested
        self.rests += 1
        self.holds_in_a_row += 1

    def can_train(self) -> bool:
        """Enough sequences, replay budget left, and neither paused by the RL loop nor resting."""
        return (len(self.buffer) >= self.cfg.min_sequences and not self.replay_exhausted() and not self.paused()
                and not self.resting())

    def replay_exhausted(self) -> bool:
        ratio = self.cfg.replay_ratio
        return ratio is not None and self.version_trained >= ratio * self.version_buffered

    def train_step(self) -> dict[str, Any]:
        picked = self.rng.sample(list(self.buffer), min(self.cfg.batch_size, len(self.buffer)))
        self.trained_samples += len(picked)
        self.version_trained += len(picked)
        return self.trainer.train_on(picked)

    def report(self) -> dict[str, Any]:
        """What the engine shows of this trainer (``/specrl/status`` ``draft_trainer``, ``/metrics``)."""
        return {"capture": self.capture_counts(), "steps": self.trainer.step_count,
                "publish_gate": self.gate.status(), "rests": self.rests,
                "rest_span_versions": self.rest_span() if self.resting() else 0}

    def send_report(self) -> None:
        """The report alone, when the gate kept the served draft (a publish carries it otherwise)."""
        if self.client is None:
            return
        try:
            self.client.report_trainer(self.report())
        except EngineKeyRefused:
            raise
        except Exception:  # noqa: BLE001 - an unreachable engine hears at the next publish or report
            pass

    def engine_lost_draft(self) -> bool:
        """Whether a replica serves an older draft than the last one published (it restarted from
        the checkpoint on disk): the gate's reference is then not what it serves, so it gets the
        trainer's draft whatever the gate says."""
        if self.client is None or self.draft_version == 0:
            return False
        try:
            served = served_draft_versions(self.client.statuses())
        except Exception:  # noqa: BLE001 - unreachable: publish() will find out and count it
            return False
        return any(version < self.draft_version for version in served)

    def restore_lost_draft(self) -> dict[str, Any] | None:
        """While resting, give a replica that restarted (it serves the draft on disk) the served draft,
        which the module holds while resting: no publish point comes until the policy moves, and an
        engine restarted mid-rest would otherwise serve the stale draft until then. Checked at most
        every ``lost_draft_check_s``; returns the log record of a publish, None otherwise."""
        now = time.monotonic()
        if now < self.next_lost_draft_check:
            return None
        self.next_lost_draft_check = now + self.cfg.lost_draft_check_s
        if not self.engine_lost_draft():
            return None
        publish, spec_decode = self.publish()
        return {"event": "restore_lost_draft", "publish": publish, "engine_spec_decode": spec_decode,
                "draft_version": self.draft_version, "policy_version": self.policy_version,
                "capture": self.capture_counts()}

    def publish(self) -> tuple[dict[str, Any] | None, dict | None]:
        """Push the draft into the engine; returns the commit record and the engine's
        acceptance counters (read from the same status call that gives its draft version)."""
        if self.client is None:
            return None, None
        spec_decode = None
        # A draft never changes what is sampled, so a replica that failed the last publish is simply
        # tried again (policy updates quarantine it instead).
        self.client.quarantined.clear()
        try:
            statuses = self.client.statuses()  # one status read per replica
            ok, first = statuses[next(iter(self.client.active))]
            if not ok:
                raise WeightSyncError(first)
            spec_decode = first["spec_decode"]
            self.draft_version = max([self.draft_version, *served_draft_versions(statuses)]) + 1
            state = self.trainer.publishable_state()
            result = self.client.update_draft(state, version=self.draft_version, trainer_report=self.report())
            if result["quarantined"]:
                self.publish_errors += 1
                result["error"] = f"not applied on {sorted(result['quarantined'])}"
            return result, spec_decode
        except EngineKeyRefused:
            raise  # every later publish would be refused too: stop, with the reason in the log
        except Exception as exc:  # noqa: BLE001 - an unreachable engine is retried, never fatal
            self.publish_errors += 1
            return {"error": repr(exc)}, spec_decode

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        t0 = time.time()
        start_step = self.trainer.step_count
        bar = tqdm(desc="online draft", unit="step", mininterval=5)
        last_metrics: dict[str, Any] = {}
        try:
            while not self.stop_requested.is_set():
                if cfg.max_steps is not None and self.trainer.step_count - start_step >= cfg.max_steps:
                    break
                if cfg.max_seconds is not None and time.time() - t0 >= cfg.max_seconds:
                    break
                self.pump(timeout_ms=10 if self.can_train() else 200)
                if not self.can_train():  # re-read: the pump may have brought sequences or a new version
                    restored = self.restore_lost_draft() if self.resting() and not self.paused() else None
                    if restored is not None:
                        self.write_log({"time": round(time.time() - t0, 3), **restored})
                    continue
                last_metrics = self.train_step()
                bar.update(1)
                record = {"time": round(time.time() - t0, 3), **last_metrics,
                          "buffer": len(self.buffer), "policy_version": self.policy_version,
                          "frames": dict(self.receiver.counters), "capture": self.capture_counts()}
                step = self.trainer.step_count
                if step % cfg.publish_every == 0:
                    verdict = record["gate"] = self.gate.decide() if self.gate.enabled else None
                    if verdict is not None and not verdict["publish"] and self.engine_lost_draft():
                        verdict.update(publish=True, reason="engine_lost_draft")
                    if verdict is None or verdict["publish"]:
                        record["publish"], record["engine_spec_decode"] = self.publish()
                        if record["publish"] is None or "error" not in record["publish"]:
                            self.gate.published(verdict)
                            self.holds_in_a_row = 0
                    else:
                        if cfg.rest_after_hold and verdict["reason"] == "not_better":
                            self.rest()
                            record["rest"] = True
                            record["rest_span_versions"] = self.rest_span()
                        self.send_report()
                    record["draft_version"] = self.draft_version
                if step % cfg.checkpoint_every == 0:
                    self.trainer.save(self.checkpoint_dir, extra={"draft_version": self.draft_version})
                self.write_log(record)
        finally:
            bar.close()
        self.trainer.save(self.checkpoint_dir, extra={"draft_version": self.draft_version})
        return {"event": "stopped" if self.stop_requested.is_set() else "finished",
                "steps": self.trainer.step_count, "resumed_from_step": self.resumed_from_step,
                "frames": dict(self.receiver.counters), "capture": self.capture_counts(),
                "publish_errors": self.publish_errors, "publish_gate": self.gate.status(),
                "draft_version": self.draft_version, "last": last_metrics}

    def write_log(self, record: dict[str, Any]) -> None:
        """One JSON line in ``--log`` (a training step, or a restored draft while resting)."""
        if self.log:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()

    def close(self) -> None:
        self.receiver.close()
        if self.log:
            self.log.close()
