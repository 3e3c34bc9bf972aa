"""Capture rows from a GPU without a device synchronisation in the step (``capture.host_staging``), with
stand-in device operations whose contract a missing wait or an early buffer reuse breaks: a non-blocking
copy lands only when an event recorded after it is waited on, and pinned buffers start out as zeros. The
reference is ``collect_step``, the blocking path the CPU engine takes, on the same step. Written for CUDA,
not run on one: these stand-ins are what is tested here."""

from __future__ import annotations

import torch

from vllm_specrl.capture import tap as tap_module
from vllm_specrl.capture.host_staging import DeviceOps, StagingPool
from vllm_specrl.capture.tap import CaptureTap, collect_staged_step, step_frames

H, V = 4, 32


class Stream:
    """A device stream: enqueued copies run in order, only as far as an event waited on reaches."""

    def __init__(self):
        self.queued: list = []
        self.done = 0

    def run_to(self, position: int) -> None:
        while self.done < position:
            self.queued[self.done]()
            self.done += 1


class Event:
    def __init__(self, stream: Stream):
        self.stream, self.position = stream, None

    def record(self) -> None:
        self.position = len(self.stream.queued)

    def synchronize(self) -> None:
        assert self.position is not None, "waited on an event never recorded"
        self.stream.run_to(self.position)


def fake_ops(stream: Stream) -> DeviceOps:
    def copy_async(dst, src):
        source = src.clone()   # stream order: the copy reads the source before the runner's next writes
        stream.queued.append(lambda: dst.copy_(source))
    return DeviceOps(pinned_empty=lambda shape, dtype: torch.zeros(shape, dtype=dtype), copy_async=copy_async,
                     new_event=lambda: Event(stream), to_device=lambda values, device: torch.tensor(values))


def view(seed: int = 0) -> dict:
    """Request "a" verifies 3 drafts (1 accepted + bonus); "b" ends its prefill with one sample."""
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.tensor([11, 12, 13, 14, 21, 22, 23]) + seed,
            "positions": torch.tensor([5, 6, 7, 8, 0, 1, 2]),
            "final_hidden": torch.randn(7, H, generator=g), "aux_hidden": [torch.randn(7, H, generator=g)] * 3,
            "logits": torch.randn(5, V, generator=g), "drafter": "eagle3",
            "requests": [{"request_id": f"a{seed}", "start": 0, "end": 4, "num_spec": 3, "sampled": [12 + seed, 7],
                          "logit_row": 0, "num_prompt_tokens": 5},
                         {"request_id": f"b{seed}", "start": 4, "end": 7, "num_spec": 0, "sampled": [9],
                          "logit_row": 4, "num_prompt_tokens": 3}]}


def assert_same_frames(got, want):
    assert [h for h, _ in got] == [h for h, _ in want]
    for (_, g), (_, w) in zip(got, want):
        assert g.keys() == w.keys()
        for key in g:
            torch.testing.assert_close(g[key], w[key], equal_nan=True, msg=key)


def test_staged_frames_are_the_blocking_paths_frames():
    stream = Stream()
    pool = StagingPool(fake_ops(stream))
    step = view()
    staged = collect_staged_step(step, pool, dtype=torch.float32, topk=2)
    assert stream.done == 0, "the step waited for its copies"
    want = step_frames(view(), dtype=torch.float32, topk=2)
    step["final_hidden"].zero_()   # the runner reuses its buffers next step: the staged rows are the step's
    assert_same_frames(staged.frames(), want)


def test_a_buffer_is_reused_only_once_its_reader_is_done_and_a_full_pool_drops_the_step():
    stream = Stream()
    pool = StagingPool(fake_ops(stream), max_buffers=8)   # one step's tensors: 8
    first = collect_staged_step(view(0), pool, dtype=torch.float32, topk=2)
    assert collect_staged_step(view(1), pool, dtype=torch.float32, topk=2) is None   # dropped, not waited for
    assert pool.counters["steps_dropped_no_buffer"] == 1
    first_frames = first.frames()   # read and handed back
    second = collect_staged_step(view(1), pool, dtype=torch.float32, topk=2)
    assert second is not None and pool.counters["buffers"] == 8   # the same buffers again
    assert_same_frames(second.frames(), step_frames(view(1), dtype=torch.float32, topk=2))
    assert_same_frames(first_frames, step_frames(view(0), dtype=torch.float32, topk=2))


def test_the_tap_stages_rows_on_a_gpu_and_copies_them_at_once_on_a_cpu(monkeypatch):
    class Sender:
        own_process, cpus = False, []

        def __init__(self):
            self.steps = []

        def offer_step(self, pending):
            self.steps.append(pending)

    stream, sender = Stream(), Sender()
    capture = CaptureTap(sender, 1.0, lambda: 7, dtype=torch.float32, topk=2, staging=StagingPool(fake_ops(stream)))
    capture(view())   # CPU tensors: the blocking path, as measured best on CPU
    assert type(sender.steps[-1]).__name__ == "StepCapture" and capture.staging.counters["steps_staged"] == 0
    monkeypatch.setattr(tap_module, "stages", lambda tensor: True)   # as if the rows were on a GPU
    capture(view())
    staged = sender.steps[-1]
    assert type(staged).__name__ == "StagedStepCapture" and stream.done == 0
    frames = staged.frames()
    assert all(h["policy_version"] == 7 and h["step"] == 2 for h, _ in frames)
    want = step_frames(view(), dtype=torch.float32, topk=2)
    assert [h["token_ids"] for h, _ in frames] == [h["token_ids"] for h, _ in want]
