"""Starting and placing the online draft trainer beside a rollout engine, from an RL loop.

``DraftTrainerProcess.start`` runs ``vllm-specrl train-draft`` on the engine's capture stream before the
first step (its start-up would otherwise land in step 0's rollouts), at low priority and, on a CPU
engine, on the CPUs the worker leaves to its engine core (``trainer_cpus``), spawned without forking
the caller (``processes.start_niced``). ``pause`` / ``resume`` stop and restart its training for the
loop's policy phases (it keeps ingesting); a trainer that dies leaves the last published draft serving.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vllm_specrl.processes import start_niced
from vllm_specrl.sync.clients.response_check import API_KEY_ENV


@dataclass(frozen=True)
class DraftTrainerSettings:
    """The knobs of ``train-draft``'s online mode an RL loop sets (the CLI documents each)."""

    publish_every: int = 4
    lr: float = 2e-4
    tv_weight: float = 0.0
    replay_ratio: float | None = 4.0
    holdout_every: int = 4
    mixed_precision: str = "auto"
    batch_size: int = 4
    checkpoint_every: int = 50
    niceness: int = 19
    sched_idle: bool = True
    yields: bool = True  # pausable for the policy phases (a pause file)
    keep_versions: int = 1        # policy versions of rollouts in the replay buffer
    rest_after_hold: bool = True  # a held candidate: back to the served draft, rest until the policy moves
    rest_backoff_max: int = 8     # each hold in a row doubles the rest, up to this many versions
    device: str = "auto"          # where it trains: auto (the GPU with the most free memory, else the CPU),
                                  # cpu, cuda:N (``trainer.placement``)


def trainer_cpus(setting: str, engine_status: dict) -> set[int] | None:
    """Where the trainer runs: ``auto``, the CPUs the engine's capture sender runs on (those its CPU
    worker's compute threads are not bound to; none on a GPU worker, then anywhere), or ``any``."""
    if setting == "any":
        return None
    return set((engine_status.get("capture") or {}).get("sender_cpus") or ()) or None


class DraftTrainerProcess:
    """One ``train-draft`` process: trains on ``capture``, publishes to ``engine_url``."""

    def __init__(self, proc: subprocess.Popen, work_dir: Path, name: str, pausable: bool = True):
        self.proc, self.work_dir, self.name = proc, work_dir, name
        self.pausable = pausable  # started watching its pause file (``DraftTrainerSettings.yields``)

    @property
    def pause_file(self) -> Path:
        return pause_file(self.work_dir, self.name)

    @property
    def checkpoint_dir(self) -> Path:
        return checkpoint_dir(self.work_dir, self.name)

    @property
    def output(self) -> Path:
        return self.work_dir / f"draft_trainer_{self.name}.out"

    @property
    def log(self) -> Path:
        return self.work_dir / f"online_draft_{self.name}.jsonl"

    @classmethod
    def start(cls, capture: str, engine_url: str, draft: str | Path, target: str | Path, work_dir: Path,
              settings: DraftTrainerSettings = DraftTrainerSettings(), mtp: bool = False,
              cpus: set[int] | None = None, name: str = "spec", start_timeout_s: float = 300.0,
              api_key: str | None = None) -> DraftTrainerProcess:
        """Start the trainer and wait until it says it started. EAGLE-3: ``draft`` is the draft directory
        and ``target`` the policy checkpoint; MTP (``mtp``): ``draft`` is the policy checkpoint and
        ``target`` what ``write_policy_head`` writes. ``api_key``: the engine's ``--api-key`` (default:
        ``VLLM_SPECRL_API_KEY``), handed over in the environment, never on the command line."""
        work_dir.mkdir(parents=True, exist_ok=True)
        pause_file(work_dir, name).unlink(missing_ok=True)
        s = settings
        cmd = [sys.executable, "-m", "vllm_specrl.cli", "train-draft", "--capture", capture, "--engine", engine_url,
               *(["--mtp"] if mtp else []), "--draft", str(draft), "--target", str(target),
               "--checkpoint-dir", str(checkpoint_dir(work_dir, name)),
               "--publish-every", str(s.publish_every), "--checkpoint-every", str(s.checkpoint_every),
               "--batch-size", str(s.batch_size), "--lr", str(s.lr), "--tv-weight", str(s.tv_weight),
               "--idle-s", "0.5", "--holdout-every", str(s.holdout_every), "--mixed-precision", s.mixed_precision,
               "--device", s.device,
               "--keep-versions", str(s.keep_versions), "--rest-backoff-max", str(s.rest_backoff_max),
               "--rest-after-hold" if s.rest_after_hold else "--no-rest-after-hold",
               *(["--replay-ratio", str(s.replay_ratio)] if s.replay_ratio is not None else []),
               *(["--pause-file", str(pause_file(work_dir, name))] if s.yields else []),
               "--log", str(work_dir / f"online_draft_{name}.jsonl")]
        out = work_dir / f"draft_trainer_{name}.out"
        proc = start_niced(cmd, niceness=s.niceness, idle=s.sched_idle, cpus=cpus,
                           stdout=open(out, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115 - the child owns it
                           env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                                    **({API_KEY_ENV: api_key} if api_key else {})))
        trainer = cls(proc, work_dir, name, pausable=s.yields)
        trainer.wait_started(start_timeout_s)
        return trainer

    def wait_started(self, timeout_s: float = 300.0) -> None:
        """Until the trainer says it started (its first output line), or it exits (an error)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.output.exists() and '"event": "started"' in self.output.read_text():
                return
            time.sleep(0.5)
        code = self.proc.poll()
        self.proc.kill()
        tail = self.output.read_text().strip().splitlines()[-1:] if self.output.exists() else []
        raise RuntimeError(f"the draft trainer did not start (exit code {code}): {' '.join(tail) or 'no output'}; "
                           f"see {self.output}")

    def pause(self) -> None:
        """Stop training (it keeps ingesting captured rows) until ``resume``."""
        if not self.pausable:
            raise RuntimeError(f"the draft trainer {self.name!r} was started without a pause file "
                               "(DraftTrainerSettings.yields=False): it cannot be paused")
        self.pause_file.touch()

    def resume(self) -> None:
        self.pause_file.unlink(missing_ok=True)

    def stop(self, timeout_s: float = 120.0) -> bool:
        """SIGINT (it checkpoints and closes its sockets between steps); killed after ``timeout_s``, so
        a stuck trainer never holds up the loop. Whether it exited by itself."""
        clean = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                clean = False
        self.resume()
        return clean


def checkpoint_dir(work_dir: Path, name: str) -> Path:
    """Where the online draft trainer checkpoints, and resumes from when it starts (``--checkpoint-dir``)."""
    return work_dir / f"draft-online-{name}"


def pause_file(work_dir: Path, name: str) -> Path:
    """While it exists the online draft trainer ingests but does not train (``--pause-file``)."""
    return work_dir / f"draft_trainer_{name}.pause"


def publish_gate_verdicts(log: Path) -> list[dict]:
    """The online trainer's publish decisions from its ``--log`` (held-out estimates of the candidate and the
    served draft, and whether it published), and after each hold the policy versions its rest spans."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if record.get("gate"):
            out.append({"time": record["time"], "trainer_step": record["step"],
                        "policy_version": record["policy_version"], **record["gate"],
                        **({"rest_span_versions": record["rest_span_versions"]} if record.get("rest") else {})})
    return out
