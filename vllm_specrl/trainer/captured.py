"""Warm-start rollouts whose training features come out of vLLM itself (the capture path).

The HF path generates rollouts with vLLM and then runs the target a second time in
transformers for its hidden states (5 of 28 minutes of `make draft` on 2 cores).
vLLM already computes those states while it generates: with an EAGLE-3 drafter
attached, the runner hands the target's aux and final hidden states to the drafter
every step, and the capture tap (``vllm_specrl.capture``) streams the committed rows
out. Here the drafter is only a vehicle: a freshly initialised draft served at k = 0
for every batch size (vLLM's ``num_speculative_tokens_per_batch_size``), so nothing is
verified and generation is plain decoding plus the drafter's KV-sync pass. The
features are then exactly the states vLLM serves with.

Prefix caching is off for this engine: every rollout's rows then start at position 0,
so the draft trains with its whole prompt as context, as vLLM serves it. A rollout
whose captured rows do not reproduce the engine's output exactly (a dropped frame) is
left out and counted.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from vllm_specrl.capture.receiver import CaptureReceiver, SequenceAssembler
from vllm_specrl.capture.sender import frames_settled
from vllm_specrl.proposer.checkpoint import init_draft, target_lm_head
from vllm_specrl.trainer.rollout_seeds import per_prompt_sampling_params


class _Drain(threading.Thread):
    """Receives frames into an assembler until stopped, so the engine's sender never backs up."""

    def __init__(self, receiver: CaptureReceiver):
        super().__init__(name="specrl-warm-start-capture", daemon=True)
        self.receiver, self.assembler = receiver, SequenceAssembler()
        self.stop = threading.Event()
        self.received = 0  # frames taken off the socket: decoded (and assembled) or rejected

    def run(self) -> None:
        while not self.stop.is_set():
            frames = self.receiver.receive(100)
            for header, tensors in frames:
                self.assembler.add(header, tensors)
            self.received = self.receiver.counters["frames"] + self.receiver.counters["rejected"]


def _wait_for_flush(llm: Any, drain: _Drain, stall_s: float = 60.0) -> dict:
    """Until every frame the worker's sender sent has been received and assembled here (and the
    sender has sent or dropped every frame it was offered), or nothing moved for ``stall_s``;
    returns the sender's final counters.

    Counting frames, not waiting for a quiet socket: with the engine in its own process the
    receiving thread could be decoding a batch of a thousand frames for longer than any quiet
    period, and stopping it then lost the rest of the stream (seen: 247 of 256 rollouts cut
    short in one of four runs of the same build)."""
    state: dict = {}
    progress, last_move = (-1, -1), time.time()
    while time.time() - last_move < stall_s:
        state = llm.collective_rpc("specrl_capture_state")[0] or {}
        done = frames_settled(state)
        if done >= state.get("frames_offered", 0) and state.get("queued", 0) == 0 \
                and drain.received >= state.get("frames_sent", 0):
            break
        if (done, drain.received) != progress:
            progress, last_move = (done, drain.received), time.time()
        time.sleep(0.2)
    return state


def features_from_capture(sequence: dict[str, Any], completion_last: int, head: torch.Tensor) -> dict:
    """One assembled request as warm-start features (the keys ``trainer.features`` produces).

    The captured rows are positions 0..L-2 of an L-token rollout (the last sampled token is
    never fed back); ``token_ids`` is the whole rollout and the last row's states are zero
    (a base with no successor, never trained on). ``target_lse`` (the full-vocabulary
    logsumexp the loss normalises with) follows from the engine's own logprob of each
    sampled token: lse = head[next] . h - logprob.
    """
    rows = sequence["token_ids"]
    tokens = torch.cat([rows, torch.tensor([completion_last])])
    aux, final = sequence["aux_hidden"], sequence["final_hidden"]
    zero = lambda x: torch.zeros(1, *x.shape[1:], dtype=x.dtype)  # noqa: E731
    nxt = sequence["next_token_ids"]
    logprobs = sequence["logprobs"]
    sampled = ~torch.isnan(logprobs)
    lse = torch.zeros(len(tokens))
    if sampled.any():
        h = final[sampled].float()
        lse[:len(rows)][sampled] = (h * head[nxt[sampled]].float()).sum(-1) - logprobs[sampled]
    return {"token_ids": tokens, "aux_hidden": torch.cat([aux, zero(aux)]),
            "final_hidden": torch.cat([final, zero(final)]), "target_lse": lse,
            "first_draft": int(sequence["first_draft"])}


class CapturedRollouts(NamedTuple):
    """Rollouts with their captured features. ``sequences``, ``prompt_lengths``, ``prompt_index`` and
    ``features`` hold the rollouts captured whole (features[i] belongs to sequences[i]); ``everything``
    holds (sequences, prompt lengths, prompt index) of every rollout the engine generated, captured or
    not, so a caller can compute the features of the lost ones another way."""

    sequences: list[list[int]]
    prompt_lengths: list[int]
    prompt_index: list[int]
    features: list[dict]
    counts: dict
    everything: tuple[list[list[int]], list[int], list[int]]


def describe_capture(counts: dict) -> str:
    """One line a build prints: how many rollouts were captured whole, and where the rest went."""
    sender = counts.get("sender", {})
    return (f"captured {counts['kept']} of {counts['rollouts']} rollouts whole ({counts['incomplete']} incomplete, "
            f"{counts['rollouts'] - counts['captured_requests']} never seen by the receiver; sender frames: "
            f"{sender.get('frames_offered', 0)} offered, {sender.get('frames_sent', 0)} sent, "
            f"{sender.get('frames_dropped_queue_full', 0)} dropped (queue full), "
            f"{sender.get('frames_dropped_no_peer', 0)} dropped (no receiver), "
            f"{sender.get('frames_dropped_peer_busy', 0)} dropped (receiver behind), "
            f"{sender.get('frames_dropped_build_error', 0)} failed to build, "
            f"tap errors {sender.get('tap_errors', 0)})")


def captured_rollouts(target_dir: Path, texts: list[str], samples: int, max_tokens: int,
                      temperature: float, seed: int, dtype: str, aux_layer_ids: tuple[int, ...] = (),
                      max_model_len: int = 2048, drafter: str = "eagle3",
                      engine_args: dict | None = None) -> CapturedRollouts:
    """T=``temperature`` rollouts of ``texts`` (``samples`` each) with their features captured.

    Rollouts whose capture was incomplete are left out of the features and counted in
    ``counts`` (``describe_capture`` says it in a line). ``drafter="mtp"``: the target ships its
    own MTP layer, which is the vehicle (held at k = 0 the same way), and the features are the
    assembled captured sequences as ``trainer.mtp.MTPTrainer`` takes them (the MTP input state of
    every row). ``engine_args``: vLLM engine arguments over the defaults (tensor parallelism, memory,
    dtype); the speculative config, worker extension and capture settings stay the vehicle's.
    """
    target_dir = Path(target_dir)
    head = target_lm_head(target_dir).float()
    outs, drain, sender = _generate_with_capture(target_dir, texts, samples, max_tokens, temperature, seed, dtype,
                                                 aux_layer_ids, max_model_len, drafter, engine_args)
    return _match_captured(outs, drain, sender, drafter, head)


def _generate_with_capture(target_dir: Path, texts: list[str], samples: int, max_tokens: int,
                           temperature: float, seed: int, dtype: str, aux_layer_ids: tuple[int, ...],
                           max_model_len: int, drafter: str, engine_args: dict | None) -> tuple[list, "_Drain", dict]:
    """One in-process engine, its drafter held at k = 0 as the capture vehicle: the rollouts, the drained
    capture stream, and the sender's counts."""
    from vllm import LLM

    from vllm_specrl.launcher import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    receiver = CaptureReceiver(address, rcv_hwm=4096)
    drain = _Drain(receiver)
    drain.start()
    with tempfile.TemporaryDirectory(prefix="specrl-vehicle-draft-") as vehicle:
        max_num_seqs = 256
        # k = 0 at every batch size: the drafter only syncs its KV (and hands the tap its inputs)
        held = {"num_speculative_tokens": 1, "num_speculative_tokens_per_batch_size": [[1, max_num_seqs, 0]]}
        if drafter == "mtp":
            spec = {"method": "mtp", **held}
        else:
            init_draft(target_dir, vehicle, aux_layer_ids=aux_layer_ids, seed=seed)
            spec = {"method": "eagle3", "model": vehicle, **held}
        own = {"speculative_config", "worker_extension_cls", "additional_config"} & set(engine_args or {})
        if own:
            raise ValueError(f"engine_args may not set {sorted(own)}: the capture vehicle sets them")
        defaults = {"dtype": dtype, "enforce_eager": True, "seed": seed, "max_model_len": max_model_len,
                    "max_num_seqs": max_num_seqs, "enable_prefix_caching": False}
        llm = LLM(model=str(target_dir), **{**defaults, **(engine_args or {})},
                  speculative_config=spec, worker_extension_cls="vllm_specrl.sync.SpecRLWorkerExtension",
                  # Every row: a deep queue, and a sender that waits for this process's receiver
                  # rather than dropping (the engine step never waits either way).
                  additional_config={"specrl": {"capture_topk": 0, "capture_queue_frames": 1 << 16,
                                                "capture_send_timeout_s": 60.0,
                                                "capture_dtype": "float32" if drafter == "mtp" else "bfloat16"}})
        try:
            started = llm.collective_rpc("specrl_capture_start", args=(address,))[0]
            if not started.get("ok"):
                raise RuntimeError(f"capture did not start: {started}")
            params = per_prompt_sampling_params(len(texts), samples, temperature, max_tokens, seed)
            outs = llm.generate(texts, params)
            sender = _wait_for_flush(llm, drain)
        finally:
            drain.stop.set()
            drain.join()
            receiver.close()
            del llm
    return outs, drain, sender


def _match_captured(outs: list, drain: "_Drain", sender: dict, drafter: str,
                    head: torch.Tensor) -> CapturedRollouts:
    """Each captured request matched to its rollout (by its tokens: the engine suffixes request ids);
    a request captured incompletely is counted and left out."""
    by_tokens: dict[tuple[int, ...], list[tuple[int, int, list[int]]]] = {}
    everything: tuple[list[list[int]], list[int], list[int]] = ([], [], [])
    for i, o in enumerate(outs):
        prompt = list(o.prompt_token_ids)
        for c in o.outputs:
            full = prompt + list(c.token_ids)
            by_tokens.setdefault(tuple(full[:-1]), []).append((i, len(prompt), full))
            for column, value in zip(everything, (full, len(prompt), i)):
                column.append(value)
    sequences, prompt_lengths, prompt_index, features = [], [], [], []
    counts = {"rollouts": sum(len(o.outputs) for o in outs), "captured_requests": len(drain.assembler.requests),
              "incomplete": 0, "sender": {k: v for k, v in sender.items() if isinstance(v, int)}}
    for rid in list(drain.assembler.requests):
        seq = drain.assembler.pop(rid)
        key = tuple(seq["token_ids"].tolist())
        match = by_tokens.get(key) if seq["start"] == 0 else None
        if not match:
            counts["incomplete"] += 1
            continue
        i, n_prompt, full = match.pop()
        if int(seq["next_token_ids"][-1]) != full[-1]:
            counts["incomplete"] += 1
            continue
        sequences.append(full)
        prompt_lengths.append(n_prompt)
        prompt_index.append(i)
        features.append(seq if drafter == "mtp" else features_from_capture(seq, full[-1], head))
    counts["kept"] = len(sequences)
    return CapturedRollouts(sequences, prompt_lengths, prompt_index, features, counts, everything)
