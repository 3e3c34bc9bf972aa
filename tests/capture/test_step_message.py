"""A step's capture crosses from the worker to its sender process unchanged, and a malformed message
is refused with ``StepMessageError`` alone."""

import pytest
import torch

from vllm_specrl.capture.step_message import StepMessageError, decode_step, encode_step
from vllm_specrl.capture.tap import collect_step


def step_view(requests: int = 5, rows: int = 3, vocab: int = 4096, hidden: int = 48) -> dict:
    """A synthetic verify step: every request verified ``rows - 1`` drafts; request 1 accepted none."""
    n = requests * rows
    gen = torch.Generator().manual_seed(0)
    view = {"input_ids": torch.arange(n), "positions": torch.arange(n) % 7,
            "logits": torch.randn(n, vocab, generator=gen),
            "aux_hidden": [torch.randn(n, hidden, generator=gen) for _ in range(3)],
            "final_hidden": torch.randn(n, hidden, generator=gen),
            "requests": [{"request_id": f"r{i}", "start": i * rows, "end": (i + 1) * rows, "num_spec": rows - 1,
                          "sampled": [3 + i] * (1 if i == 1 else rows), "logit_row": i * rows,
                          "num_prompt_tokens": 11 + i} for i in range(requests)]}
    view["raw_logprobs"] = view["logits"].log_softmax(-1)
    return view


def assert_same_frames(got, want):
    assert len(got) == len(want)
    for (h1, t1), (h2, t2) in zip(got, want):
        assert h1 == h2
        assert t1.keys() == t2.keys()
        for name in t1:
            assert t1[name].dtype == t2[name].dtype, name
            torch.testing.assert_close(t1[name], t2[name], rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("defer_scoring", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_step_decodes_to_the_frames_the_worker_would_have_built(defer_scoring, dtype):
    """Deferred (the logit rows travel, the sender process scores) and scored in the step alike."""
    view = step_view()
    want = collect_step(view, dtype=dtype, topk=8, defer_scoring=defer_scoring).frames()
    parts = encode_step(collect_step(view, dtype=dtype, topk=8, defer_scoring=defer_scoring))
    got = decode_step([bytes(p) for p in parts]).frames()
    assert_same_frames(got, want)
    assert all("topk_ids" in t for _, t in got)


def test_a_step_without_logits_or_aux_layers_crosses_too():
    view = step_view()
    view["logits"] = view["raw_logprobs"] = None
    view["aux_hidden"] = []
    want = collect_step(view, topk=8).frames()
    got = decode_step([bytes(p) for p in encode_step(collect_step(view, topk=8))]).frames()
    assert_same_frames(got, want)
    assert all(set(t) == {"final_hidden"} for _, t in got)


@pytest.mark.parametrize("damage", ["drop_a_tensor", "not_json", "shape", "dtype", "empty"])
def test_a_malformed_step_message_is_refused(damage):
    parts = [bytes(p) for p in encode_step(collect_step(step_view(), topk=8, defer_scoring=True))]
    if damage == "drop_a_tensor":
        parts = parts[:-1]
    elif damage == "not_json":
        parts[0] = b"\xff" + parts[0]
    elif damage == "shape":
        parts[0] = parts[0].replace(b'"final", "bfloat16", [', b'"final", "bfloat16", [3, ')
    elif damage == "dtype":
        parts[0] = parts[0].replace(b'"bfloat16"', b'"complex64"', 1)
    else:
        parts = []
    with pytest.raises(StepMessageError):
        decode_step(parts)
