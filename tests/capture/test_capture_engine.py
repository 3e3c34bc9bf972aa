"""Captured hidden states equal an HF forward of the same tokens on the same weights.

Also for requests the scheduler preempted (KV recomputed: re-sent rows overwrite by position) and
a request aborted mid-generation (its rows up to the abort).

An in-process engine (float32, EAGLE-3 with a random draft, so most drafts are
rejected and only committed rows may be sent) streams frames to a PULL socket
in the same process; the assembled sequences are compared in the test process
with transformers' hidden states for prompt + output tokens.

Engines: three in-process engines, one per scenario (T=1 rollouts; preemption and an abort on
a tiny KV cache; a GRPO group across a policy commit), each with its own receiver and KV-cache size.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from helpers import result_json, run_python
from vllm_specrl.proposer.checkpoint import init_draft
from vllm_specrl.launcher import free_port
from vllm_specrl.trainer.features import sequence_features

PROMPTS = ["def f(x):\n    return", "import os\nimport sys\n", "class A:\n    def __init__(self):",
           "for i in range(10):\n    print(", "x = " + "[1, 2, 3] + " * 30]
EIGHT_PROMPTS = PROMPTS + ["while True:\n", "try:\n    pass\n", "with open(p) as f:\n"]


# Drain the receiver until the engine's sender is idle, then save each request's assembled rows.
COLLECT = """
deadline = time.time() + 20
state = None
while time.time() < deadline:
    for header, tensors in rx.receive(200):
        asm.add(header, tensors)
    state = llm.collective_rpc("specrl_capture_state")[0]
    if frames_settled(state) >= state["frames_offered"] and state["queued"] == 0 and not rx.pending(300):
        break
seqs, runs = {}, []
for i, rid in enumerate(request_ids):
    # vLLM suffixes the engine-side request id ("0" -> "0-1a2b3c4d").
    key = next(k for k in asm.requests if k == rid or k.startswith(rid + "-"))
    runs.append({str(v): list(asm.requests[key].trainable_run(v)) for v in (0, 1)})
    for k, v in asm.pop(key).items():
        seqs[f"{i}.{k}"] = v.contiguous() if torch.is_tensor(v) else torch.tensor(v)
save_file(seqs, OUT)
def torch_threads(worker):  # what a thread the worker starts inherits
    import torch
    return torch.get_num_threads()
print("RESULT " + json.dumps({"tokens": tokens, "state": state, "rx": rx.counters, "runs": runs,
                             "worker_torch_threads": llm.collective_rpc(torch_threads)[0], **extra}))
"""


def run_capture(tiny_model, work, engine_kwargs: str, drive: str) -> tuple[dict, dict]:
    """One in-process engine with capture on; ``drive`` must set ``request_ids``, ``tokens`` (prompt +
    output ids per request) and ``extra``."""
    if not (work / "draft" / "config.json").exists():
        init_draft(tiny_model, work / "draft", seed=0)
    addr = f"tcp://127.0.0.1:{free_port()}"
    out = work / f"captured_{free_port()}.safetensors"
    script = f"""
import json, time
import torch
from safetensors.torch import save_file
from vllm import LLM, SamplingParams
from vllm_specrl.capture.receiver import CaptureReceiver, SequenceAssembler
from vllm_specrl.capture.sender import frames_settled
OUT = {str(out)!r}
rx = CaptureReceiver({addr!r})
asm = SequenceAssembler()
llm = LLM(model={str(tiny_model)!r}, dtype="float32", enforce_eager=True, max_model_len=512,
          max_num_batched_tokens=64, max_num_seqs=8, {engine_kwargs}
          speculative_config={{"method": "eagle3", "model": {str(work / "draft")!r},
                               "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}},
          worker_extension_cls="vllm_specrl.sync.SpecRLWorkerExtension")
print("START", llm.collective_rpc("specrl_capture_start", args=({addr!r},)))
{drive}
{COLLECT}
"""
    meta = result_json(run_python(script, env={"VLLM_PLUGINS": "specrl"}))
    return meta, load_file(out)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("capture")


@pytest.fixture(scope="module")
def captured(tiny_model, work):
    # The sender on every CPU this process has, named: as on a CPU engine whose worker is bound to some of
    # them, a sender process scores the logit rows the step copied (the preempted run below: the default
    # placement). At normal priority: this engine runs on those CPUs flat out, and every
    # row is asked for (at SCHED_IDLE a starved sender drops steps, as it may beside a real engine).
    cpus = sorted(os.sched_getaffinity(0))
    return run_capture(tiny_model, work, f'additional_config={{"specrl": {{"capture_sender_cpus": {cpus}, '
                                         f'"capture_sender_sched": "normal"}}}},',
                       f"""
params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=0, logprobs=0)
outs = llm.generate({PROMPTS!r}, params, use_tqdm=False)
request_ids = [o.request_id for o in outs]
tokens = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
extra = {{"vllm_logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                           for o in outs]}}
""")


@pytest.fixture(scope="module")
def captured_preempted_aborted(tiny_model, work):
    """8 long requests on a KV cache of 8 blocks (128 tokens each) so the scheduler preempts and
    recomputes them, and one request aborted after 20 tokens, driven step by step."""
    return run_capture(tiny_model, work, "num_gpu_blocks_override=8, disable_log_stats=False,", f"""
eng = llm.llm_engine
prompts = {EIGHT_PROMPTS!r}
request_ids = [f"r{{i}}" for i in range(len(prompts))]
for rid, p, seed in zip(request_ids, prompts, range(len(prompts))):
    eng.add_request(rid, p, SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True, seed=seed,
                                           logprobs=0))
latest, aborted, logprobs = {{}}, None, {{}}
while eng.has_unfinished_requests():
    for header, tensors in rx.receive(0):  # drain as a trainer does (ZeroMQ's buffers are bounded)
        asm.add(header, tensors)
    for o in eng.step():
        latest[o.request_id] = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        logprobs[o.request_id] = [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
        if aborted is None and o.request_id == "r3" and len(o.outputs[0].token_ids) >= 20:
            eng.abort_request(["r3"])
            aborted = "r3"
tokens = [latest[rid] for rid in request_ids]
metrics = {{m.name: getattr(m, "value", None) for m in llm.get_metrics()}}
extra = {{"preemptions": metrics.get("vllm:num_preemptions"), "aborted": 3,
         "vllm_logprobs": [logprobs[rid] for rid in request_ids]}}
""")


@pytest.fixture(params=["plain", "preempted_aborted"])
def capture_run(request):
    return request.getfixturevalue("captured" if request.param == "plain" else "captured_preempted_aborted")


def test_preemptions_and_abort_happened(captured_preempted_aborted):
    meta, _ = captured_preempted_aborted
    assert meta["preemptions"] > 0
    assert len(meta["tokens"][meta["aborted"]]) < len(meta["tokens"][0])  # cut short


def test_capture_streams_every_committed_row(capture_run):
    meta, seqs = capture_run
    state = meta["state"]
    assert state["tap_errors"] == 0, state
    assert state["frames_dropped_queue_full"] == state["frames_dropped_no_peer"] == 0, state
    assert state["frames_dropped_peer_busy"] == 0, state
    assert meta["rx"]["rejected"] == 0 and meta["rx"]["frames"] == state["frames_sent"]
    for i, tokens in enumerate(meta["tokens"]):
        n = len(tokens) - 1  # the last output token is never forwarded
        ids = seqs[f"{i}.token_ids"].tolist()
        assert ids[:n] == tokens[:-1], f"request {i}: captured tokens differ from prompt + output"
        assert seqs[f"{i}.next_token_ids"].tolist()[:n] == tokens[1:]
        # At max_tokens the engine trims sampled tokens from the output; rows of
        # accepted drafts beyond the limit may still be sent (true target states).
        assert 0 <= len(ids) - n <= 3, (i, len(ids), n)


def test_captured_hidden_states_equal_hf_forward(tiny_model, capture_run):
    from transformers import AutoModelForCausalLM

    meta, seqs = capture_run
    cfg = json.loads((tiny_model / "config.json").read_text())
    from vllm_specrl.proposer.eagle3_config import default_aux_layer_ids

    aux_ids = default_aux_layer_ids(cfg["num_hidden_layers"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ref = sequence_features(model, [t[:-1] for t in meta["tokens"]], aux_ids, dtype=torch.float32)
    for i, r in enumerate(ref):
        for key in ("aux_hidden", "final_hidden"):
            got, want = seqs[f"{i}.{key}"][: len(r[key])].float(), r[key]
            assert len(got) == len(want), (i, key)
            # Per row (each position's state on its own scale; bf16 transport: ~0.4% per row).
            err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max()
            assert err < 0.02, f"request {i} {key}: worst row error {err:.4f} of the row's norm"



def test_captured_logprobs_equal_vllms(capture_run):
    """The sampled tokens' logprobs the tap sends are those vLLM returns (raw_logprobs, float32), read
    at every step from the log-softmax the step's sampler took (the one-pass verify's, or vLLM's
    sampler's for requests that ask for logprobs)."""
    meta, seqs = capture_run
    assert meta["state"]["steps_scored_by_sampler"] == meta["state"]["steps"] > 0, meta["state"]
    # Where the sender has CPUs of its own it scored every step (the plain run), else the step did.
    # (a sender process always, a sender thread where the worker's torch pool it inherits fits those CPUs).
    state = meta["state"]
    deferred = state["sender_cpus"] and ("sender_process" in state
                                         or len(state["sender_cpus"]) >= meta["worker_torch_threads"])
    assert meta["state"]["steps_scored_by_sender"] == (meta["state"]["steps"] if deferred else 0), meta["state"]
    for i, (tokens, want) in enumerate(zip(meta["tokens"], meta["vllm_logprobs"])):
        got = seqs[f"{i}.logprobs"]
        first = len(tokens) - len(want) - 1  # the row whose next token is the first output token
        assert torch.isnan(got[:first]).all(), f"request {i}: prompt rows carry a logprob"
        torch.testing.assert_close(got[first:first + len(want)], torch.tensor(want), atol=1e-3, rtol=0,
                                   msg=lambda m: f"request {i}: {m}")


def test_captured_prompt_length_and_topk_targets(capture_run):
    """Each sequence knows where vLLM starts drafting (prompt length - 1), and the default top-K
    soft targets agree with the sampled tokens' logprobs wherever those are in the top K."""
    meta, seqs = capture_run
    for i, (tokens, want) in enumerate(zip(meta["tokens"], meta["vllm_logprobs"])):
        first = len(tokens) - len(want) - 1
        assert int(seqs[f"{i}.first_draft"]) == first, f"request {i}"
        values, ids = seqs[f"{i}.topk_logprobs"], seqs[f"{i}.topk_ids"]
        assert values.shape[1] == 64
        assert torch.isnan(values[:first]).all() and not torch.isnan(values[first:first + len(want)]).any()
        nxt = seqs[f"{i}.next_token_ids"]
        for row in range(first, first + len(want)):
            assert values[row, 0] >= seqs[f"{i}.logprobs"][row] - 1e-4   # sorted: the top is the max
            hit = (ids[row] == nxt[row]).nonzero()
            if len(hit):
                assert abs(float(values[row, hit[0, 0]]) - float(seqs[f"{i}.logprobs"][row])) < 1e-4


GROUP_PROMPT = "def f(x):\n" + "    x = x + 1\n" * 60  # ~ 400 tokens: several full KV blocks to share
GROUP = 4


@pytest.fixture(scope="module")
def captured_group_across_a_commit(tiny_model, work):
    """A GRPO group (G=4 samples of one prompt, prefix caching on as vLLM defaults) generated in two
    epochs; a policy commit (v1, the same weights) lands while epoch 2 decodes."""
    return run_capture(tiny_model, work, "disable_log_stats=False,", f"""
from safetensors.torch import load_file as _load
eng = llm.llm_engine
request_ids, latest, commit_at = [], {{}}, {{}}
def run_epoch(epoch, commit_mid_decode=False):
    ids = [f"e{{epoch}}g{{i}}" for i in range({GROUP})]
    for i, rid in enumerate(ids):
        eng.add_request(rid, {GROUP_PROMPT!r}, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True,
                                                               seed=10 * epoch + i))
    steps = 0
    while eng.has_unfinished_requests():
        for header, tensors in rx.receive(0):
            asm.add(header, tensors)
        for o in eng.step():
            latest[o.request_id] = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        steps += 1
        decoding = all(len(latest.get(r, ())) >= prompt_len + 8 for r in ids)
        if commit_mid_decode and decoding and not commit_at:
            uid = llm.collective_rpc("specrl_begin_update", args=("policy", 1, "u1"))[0]["update_id"]
            llm.collective_rpc("specrl_stage_tensors", args=(uid, _load({str(tiny_model / "model.safetensors")!r})))
            assert llm.collective_rpc("specrl_commit_update", args=(uid,))[0]["ok"]
            for rid in ids:
                commit_at[rid] = len(latest[rid]) - 1  # the row of the last token forwarded under v0 + 1
    request_ids.extend(ids)
prompt_len = len(llm.get_tokenizer()({GROUP_PROMPT!r})["input_ids"])
run_epoch(1)
run_epoch(2, commit_mid_decode=True)
tokens = [latest[rid] for rid in request_ids]
metrics = {{m.name: getattr(m, "value", None) for m in llm.get_metrics()}}
extra = {{"prefix_cache_hits": metrics.get("vllm:prefix_cache_hits"),
          "commit_at": [commit_at.get(r) for r in request_ids]}}
""")


def test_a_grpo_group_keeps_its_prefix_cached_rows(tiny_model, captured_group_across_a_commit):
    """Siblings that start after a cached prefix still give the rows vLLM computed, at the right
    positions (equal to an HF forward there); the request that computed the prefix starts at 0."""
    from transformers import AutoModelForCausalLM

    from vllm_specrl.proposer.eagle3_config import default_aux_layer_ids

    meta, seqs = captured_group_across_a_commit
    assert meta["prefix_cache_hits"] > 0, meta  # the premise: the siblings hit the cache
    starts = [int(seqs[f"{i}.start"]) for i in range(2 * GROUP)]
    assert starts[0] == 0 and sum(s > 0 for s in starts[:GROUP]) >= GROUP - 1, starts
    cfg = json.loads((tiny_model / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ref = sequence_features(model, [t[:-1] for t in meta["tokens"][:GROUP]],
                            default_aux_layer_ids(cfg["num_hidden_layers"]), dtype=torch.float32)
    prompt_len = len(meta["tokens"][0]) - 40
    for i, r in enumerate(ref):
        start, ids = starts[i], seqs[f"{i}.token_ids"]
        assert start < prompt_len - 1 and ids.tolist() == meta["tokens"][i][start:start + len(ids)]
        assert int(seqs[f"{i}.first_draft"]) == prompt_len - 1 - start
        want = r["final_hidden"][start:start + len(ids)]
        got = seqs[f"{i}.final_hidden"][: len(want)].float()  # a row past max_tokens has no reference
        assert len(want) > 40 and ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 0.02, i


def test_requests_spanning_a_commit_keep_the_rows_of_the_version_they_were_generated_under(
        captured_group_across_a_commit):
    """Epoch 2's requests were decoding when v1 was committed: the rows forwarded before the commit
    are v0's, the rest v1's, split exactly at the first row forwarded after it."""
    meta, seqs = captured_group_across_a_commit
    for i in range(GROUP):  # epoch 1: all v0
        start, n = meta["runs"][i]["0"]
        assert meta["runs"][i]["1"] == [0, 0] and start + n == len(seqs[f"{i}.token_ids"]) + int(seqs[f"{i}.start"])
    for i in range(GROUP, 2 * GROUP):
        at = meta["commit_at"][i]
        (start0, n0), (start1, n1) = meta["runs"][i]["0"], meta["runs"][i]["1"]
        assert start0 + n0 == at and start1 == at, (i, at, meta["runs"][i])
        assert start1 + n1 == int(seqs[f"{i}.start"]) + len(seqs[f"{i}.token_ids"])  # to the last row
