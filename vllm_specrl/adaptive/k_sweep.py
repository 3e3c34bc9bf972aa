"""Start-up calibration of adaptive k: what a step of every k costs, measured before the rollouts.

The controller needs a step's cost at every k and batch size. Measured on live rollouts, that
cost is paid in the first RL steps: a rollout's bulk runs at 8-16 sequences only until its
first answers end, too few steps to measure k = 0..3 in, so every bucket spends its first
steps at k's that cannot pay (each dearer than a plain step at 16 sequences on a small CPU).
Costs belong to the hardware and the models, not to the prompts, so they can be measured
once, at start-up, like vLLM captures its CUDA graphs per batch size: a few synthetic
requests of ``n`` = 16, 15, 11, 7, 5, 3, 2, 1 sequences (one batch bucket each, its largest
batch; ``ignore_eos``), which
the scheduler recognises by their request ids (``calibration_ids``: a secret the caller gets from the
authenticated ``POST /specrl/calibrate``) and sweeps every k on. Their acceptance is
kept out of the controller's estimate: drafts of the real workload choose k from the first
real step on.

``calibrate(url, model)`` (or ``vllm-specrl calibrate --engine URL``) against a plain engine
runs the same requests and only warms it up (oneDNN builds its kernels per shape on first
use), so a speculative and a plain run can be given the same start.
"""

from __future__ import annotations

import time
import uuid

import requests

from vllm_specrl.sync.clients import response_check
from vllm_specrl.adaptive.calibration_ids import is_calibration_request, only_calibration, request_id
from vllm_specrl.adaptive.estimators import batch_bucket, bucket_bounds

__all__ = ["calibrate", "calibration_batch_sizes", "bucket_label", "is_calibration_request", "only_calibration"]

PROMPT = "Count from one to one thousand in words, one number per line:\n"
WARM_UP_TOKENS = 64  # per request on an engine without adaptive k: it sees every batch size's shapes


def calibration_batch_sizes(max_batch: int) -> list[int]:
    """One batch size per bucket up to ``max_batch``, largest first: each bucket's largest (its
    costliest: a k measured there is served at no batch where it costs more), ``max_batch`` for its own."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return [min(bucket_bounds(b)[1], max_batch) for b in range(batch_bucket(max_batch), -1, -1)]


def bucket_label(buckets: dict, batch: int) -> str | None:
    """The key of ``/specrl/status``'s adaptive-k bucket that holds ``batch`` sequences."""
    for label in buckets:
        lo, hi = (int(x) for x in label.split("-"))
        if lo <= batch <= hi:
            return label
    return None


def calibrate(url: str, model: str | None = None, max_batch: int = 16, steps: int = 256, max_rounds: int = 3,
              api_key: str | None = None, seed: int = 0, timeout_s: float = 600.0) -> dict:
    """Sweep every batch bucket up to ``max_batch`` until the engine's controller says it measured
    every k there (at most ``max_rounds`` requests of up to ``steps`` tokens each); returns what it did
    and the buckets' state. An engine without adaptive k gets one request per batch size; a bucket
    where a whole request gave no steady step (every request verifying the same k) is given up.
    ``model``: the served model's name (default: the first ``/v1/models`` lists)."""
    session = requests.Session()
    if api_key:
        session.headers["Authorization"] = f"Bearer {api_key}"
    url = url.rstrip("/")
    if model is None:
        r = session.get(url + "/v1/models", timeout=timeout_s)
        r.raise_for_status()
        model = r.json()["data"][0]["id"]

    r = session.post(url + "/specrl/calibrate", timeout=timeout_s)
    response_check.raise_for_status(r)
    token = r.json()["token"]

    def adaptive_state() -> dict | None:
        r = session.get(url + "/specrl/status", timeout=timeout_s)
        response_check.raise_for_status(r)
        return r.json().get("adaptive_k")

    def bucket_of(state: dict | None, batch: int) -> dict | None:
        label = bucket_label(state["buckets"], batch) if state else None
        return state["buckets"][label] if label else None

    def samples_of(bucket: dict | None) -> int:
        return sum(bucket["samples"]) if bucket else 0

    start = time.perf_counter()
    done = []
    state = adaptive_state()
    for batch in calibration_batch_sizes(max_batch):
        t0, rounds, swept = time.perf_counter(), 0, False
        while rounds < max_rounds and not swept:
            measured = samples_of(bucket_of(state, batch))
            # Streamed, and dropped as soon as the bucket is done (vLLM aborts a request whose
            # client went away): a sweep costs the steps it measures, not ``steps`` tokens.
            with session.post(url + "/v1/completions", timeout=timeout_s, stream=True,
                              headers={"X-Request-Id": request_id(token, batch, uuid.uuid4().hex[:8])},
                              json={"model": model, "prompt": PROMPT, "n": batch,
                                    "max_tokens": steps if state is not None else WARM_UP_TOKENS,
                                    "temperature": 1.0, "ignore_eos": True, "seed": seed + rounds * batch,
                                    "stream": True}) as r:
                r.raise_for_status()
                checked = time.perf_counter()
                for _ in r.iter_lines():
                    if state is not None and time.perf_counter() - checked > 0.5:
                        checked = time.perf_counter()
                        if (bucket_of(adaptive_state(), batch) or {}).get("swept"):
                            break
            rounds += 1
            state = adaptive_state()
            if state is None:
                break  # no adaptive k: one request per batch size warms the engine up
            bucket = bucket_of(state, batch)
            swept = bool(bucket and bucket["swept"])
            if not swept and samples_of(bucket) == measured:
                break  # no steady step at all: a proposer whose draft lengths vary per request (history)
        bucket = bucket_of(state, batch)
        done.append({"batch": batch, "rounds": rounds, "seconds": round(time.perf_counter() - t0, 3),
                     "swept": swept, "best_k": bucket["best_k"] if bucket else None})
    return {"seconds": round(time.perf_counter() - start, 3), "adaptive_k": state is not None,
            "batches": done, "buckets": state["buckets"] if state else None}
