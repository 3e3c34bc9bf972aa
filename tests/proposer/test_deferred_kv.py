"""Deferred draft-KV sync at k = 0 (``deferred_kv.install_deferred_draft_kv``).

An EAGLE-3 engine whose batch-size table drafts nothing while two or more requests
run and k = 3 once one is left (an RL step's tail): with the deferral the drafter's
k = 0 passes are skipped and replayed in one pass when drafting resumes. The reference
is vLLM's own path (``VLLM_SPECRL_DEFER_DRAFT_KV=0``, a pass every step) in the same
settings: every draft the survivor proposes in its tail must be the same tokens, so its
draft KV cache was rebuilt entry for entry, and outputs must be identical (greedy and
seeded temperature 1). A planted fault (held rows dropped instead of replayed: holes in
the draft's KV cache) must change drafts, or the comparison proves nothing. Both drafter kinds:
a sequential EAGLE-3 draft, and a parallel (P-EAGLE) one, whose every pass, the replay's too,
also writes its mask slots after each request's rows.

Engines: one in-process engine per case, with and without the deferral: the patch is installed when
an engine starts.
"""

import textwrap

import pytest

from helpers import result_json, run_python
from prompts import code_prompts
from vllm_specrl.cpu.deferred_draft_kv import DEFER_DRAFT_KV_ENV

PROMPTS = code_prompts(4)
MAX_TOKENS = [6, 12, 18, 72]   # the last request decodes alone, at k = 3, for its last ~54 tokens

PLANT_HOLES = """
from vllm_specrl.cpu import draft_kv_stash
_take = draft_kv_stash.DraftKVStash.take
draft_kv_stash.DraftKVStash.take = lambda self, *a: _take(self, *a) and None
"""


def tail_run(model, draft, env: dict | None = None, plant: str = "", parallel: bool = False,
             greedy_waves: list[list[int]] | None = None, max_num_seqs: int = 8,
             max_num_batched_tokens: int | None = None, compiled: bool = False) -> dict:
    """Greedy waves (max_tokens per request, one wave after another) with their drafts recorded,
    then a seeded temperature-1 wave of ``MAX_TOKENS``. ``compiled``: vLLM's torch.compile mode, its
    default, instead of eager."""
    batched = {"max_num_batched_tokens": max_num_batched_tokens} if max_num_batched_tokens else {}
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic",
            "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 64, 0]],
            **({"parallel_drafting": True} if parallel else {})}
    out = run_python(plant + textwrap.dedent(f"""
        import json
        from vllm import LLM, SamplingParams
        from vllm_specrl.capture import runner_hooks
        from vllm_specrl.cpu import deferred_draft_kv as deferred_kv
        llm = LLM(model={str(model)!r}, dtype="float32", enforce_eager={not compiled}, seed=0, max_model_len=512,
                  max_num_seqs={max_num_seqs}, speculative_config={spec!r},
                  **{batched!r})
        drafts = []
        llm.collective_rpc(lambda w: runner_hooks.install_draft_recorder(w.model_runner, lambda records: drafts.extend(
            [r["request_id"].split("-")[0], r["base_position"], r["draft_token_ids"]] for r in records
            if r["draft_token_ids"])) and None)
        tokens = []
        for wave in {greedy_waves or [MAX_TOKENS]!r}:
            greedy = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in wave]
            tokens += [list(o.outputs[0].token_ids) for o in llm.generate({PROMPTS!r}[:len(wave)], greedy,
                                                                          use_tqdm=False)]
        greedy_drafts = list(drafts)
        seeded = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True, seed=50 + i)
                  for i, m in enumerate({MAX_TOKENS!r})]
        sampled = [list(o.outputs[0].token_ids) for o in llm.generate({PROMPTS!r}, seeded, use_tqdm=False)]
        counters = llm.collective_rpc(deferred_kv.deferred_draft_kv_counters)[0]
        print("RESULT " + json.dumps({{"tokens": tokens, "sampled": sampled, "drafts": greedy_drafts,
                                       "counters": counters}}))
    """), env={"VLLM_PLUGINS": "specrl", **(env or {})}, timeout=900 if compiled else 600)
    return result_json(out)


def same_drafts(run: dict, reference: dict) -> tuple[int, int]:
    """(proposals at the same request and position with the same tokens, proposals compared)."""
    ref = {(rid, pos): draft for rid, pos, draft in reference["drafts"]}
    pairs = [(draft, ref[(rid, pos)]) for rid, pos, draft in run["drafts"] if (rid, pos) in ref]
    return sum(a == b for a, b in pairs), len(pairs)


@pytest.fixture(scope="module", params=["sequential", "parallel"])
def drafter(request, warm_draft) -> tuple[str, bool]:
    """(draft path, parallel drafting) for each kind of EAGLE-3 drafter."""
    if request.param == "parallel":
        return str(request.getfixturevalue("parallel_draft")), True
    return str(warm_draft), False


@pytest.fixture(scope="module")
def stock(tiny_model, drafter):
    draft, parallel = drafter
    return tail_run(tiny_model, draft, env={DEFER_DRAFT_KV_ENV: "0"}, parallel=parallel)


@pytest.fixture(scope="module")
def deferred(tiny_model, drafter):
    draft, parallel = drafter
    return tail_run(tiny_model, draft, parallel=parallel)


def test_deferred_passes_rebuild_the_draft_kv_exactly(stock, deferred):
    assert stock["counters"] is None
    c = deferred["counters"]
    # Both waves: requests 1-3 decode at k = 0 while others run; only the survivor's rows are replayed.
    assert c["replays"] >= 2 and c["rows_replayed"] >= 2 * 17, c
    # Most held steps are held before vLLM gathers the drafter's inputs (not the first steps of a
    # drafter, nor one whose stash is full).
    assert c["held_early"] >= c["steps_deferred"] // 2, c
    assert c["rows_deferred"] == c["rows_replayed"] + c["rows_dropped"] + c["rows_held"], c
    same, compared = same_drafts(deferred, stock)
    assert compared >= 2 * 10 and compared == len(stock["drafts"]), (compared, len(stock["drafts"]))
    assert same == compared, f"{compared - same} of {compared} tail drafts differ from vLLM's own KV sync"


def test_outputs_are_unchanged(stock, deferred):
    assert deferred["tokens"] == stock["tokens"]
    assert deferred["sampled"] == stock["sampled"]


# Two at a time (max_num_seqs = 2), so requests join a running batch at k = 0: the joining step's
# prompt is passed alone and the running request's row is held. Wave 1: the survivor (80 tokens)
# decoded beside two joins; wave 2: the survivor (90) joined a running batch itself.
JOINING_WAVES = [[6, 80, 10, 10], [6, 40, 10, 90]]


@pytest.fixture(scope="module")
def joining_stock(tiny_model, drafter):
    draft, parallel = drafter
    return tail_run(tiny_model, draft, env={DEFER_DRAFT_KV_ENV: "0"}, parallel=parallel,
                    greedy_waves=JOINING_WAVES, max_num_seqs=2)


def test_requests_joining_at_k0_leave_the_held_rows_held(tiny_model, drafter, joining_stock):
    draft, parallel = drafter
    joined = tail_run(tiny_model, draft, parallel=parallel, greedy_waves=JOINING_WAVES, max_num_seqs=2)
    c = joined["counters"]
    # 2 joins per greedy wave, 2 in the seeded one (4 requests, two at a time)
    assert c["prompt_passes"] >= 6, c
    assert c["rows_deferred"] == c["rows_replayed"] + c["rows_dropped"] + c["rows_held"], c
    same, compared = same_drafts(joined, joining_stock)
    assert compared >= 2 * 15 and compared == len(joining_stock["drafts"]), (compared, len(joining_stock["drafts"]))
    assert same == compared, f"{compared - same} of {compared} tail drafts differ from vLLM's own KV sync"
    assert joined["tokens"] == joining_stock["tokens"] and joined["sampled"] == joining_stock["sampled"]


# A stash of 32 rows (the drafter's buffers: max_num_batched_tokens, one pass) fills in the joining
# waves: it first forgets the rows of the requests that left the batch, then replays if still full.
SMALL_STASH = 32
ONE_PASS_STASH = """
from vllm_specrl.cpu import deferred_draft_kv as deferred_kv
deferred_kv.STASH_PASSES = 1
"""


@pytest.fixture(scope="module")
def small_stash_stock(tiny_model, warm_draft):
    return tail_run(tiny_model, str(warm_draft), env={DEFER_DRAFT_KV_ENV: "0"}, greedy_waves=JOINING_WAVES,
                    max_num_seqs=2, max_num_batched_tokens=SMALL_STASH)


def test_a_full_stash_forgets_requests_that_left_and_the_drafts_stay_vllms(tiny_model, warm_draft, small_stash_stock):
    """Planted: forgetting every held row, not only the absent requests' -> tail drafts differ."""
    run = tail_run(tiny_model, str(warm_draft), greedy_waves=JOINING_WAVES, max_num_seqs=2,
                   max_num_batched_tokens=SMALL_STASH, plant=ONE_PASS_STASH)
    c = run["counters"]
    assert c["forgets"] >= 2 and c["rows_dropped"] > 0, c
    assert c["rows_deferred"] == c["rows_replayed"] + c["rows_dropped"] + c["rows_held"], c
    same, compared = same_drafts(run, small_stash_stock)
    assert compared >= 2 * 15 and compared == len(small_stash_stock["drafts"]), compared
    assert same == compared, f"{compared - same} of {compared} tail drafts differ from vLLM's own KV sync"
    assert run["tokens"] == small_stash_stock["tokens"] and run["sampled"] == small_stash_stock["sampled"]


# Two requests decode together at k = 0 for 70 steps, then the survivor alone at k = 3: its 70 held rows
# are more than one drafter pass carries (32 rows; the stash holds STASH_PASSES passes), so the replay
# runs in passes, the survivor cut between them.
LONG_HOLD_WAVES = [[70, 100]]


@pytest.fixture(scope="module")
def long_hold_stock(tiny_model, drafter):
    draft, parallel = drafter
    return tail_run(tiny_model, draft, env={DEFER_DRAFT_KV_ENV: "0"}, parallel=parallel, greedy_waves=LONG_HOLD_WAVES,
                    max_num_seqs=2, max_num_batched_tokens=SMALL_STASH)


def test_a_replay_of_more_rows_than_a_pass_runs_in_passes_and_the_drafts_stay_vllms(tiny_model, drafter,
                                                                                     long_hold_stock):
    """Planted (the last pass not run) -> tail drafts differ. A pass's KV lengths are not seen here: a
    one-layer drafter's KV entries do not depend on its attention (``test_draft_kv_stash`` checks them)."""
    draft, parallel = drafter
    run = tail_run(tiny_model, draft, parallel=parallel, greedy_waves=LONG_HOLD_WAVES, max_num_seqs=2,
                   max_num_batched_tokens=SMALL_STASH)
    c = run["counters"]
    assert c["replay_passes"] >= c["replays"] + 2 and c["forgets"] == 0, c
    assert c["rows_deferred"] == c["rows_replayed"] + c["rows_dropped"] + c["rows_held"], c
    same, compared = same_drafts(run, long_hold_stock)
    assert compared >= 10 and compared == len(long_hold_stock["drafts"]), compared
    assert same == compared, f"{compared - same} of {compared} tail drafts differ from vLLM's own KV sync"
    assert run["tokens"] == long_hold_stock["tokens"] and run["sampled"] == long_hold_stock["sampled"]


@pytest.mark.slow
def test_a_compiled_engine_replays_the_draft_kv_exactly(tiny_model, warm_draft):
    """In vLLM's default mode the drafter is a compiled graph too, and the replay calls it with row
    counts no decode step has (planted, holes as below: the drafts differ)."""
    stock_run = tail_run(tiny_model, str(warm_draft), env={DEFER_DRAFT_KV_ENV: "0"}, compiled=True)
    run = tail_run(tiny_model, str(warm_draft), compiled=True)
    c = run["counters"]
    assert c["replays"] >= 2 and c["rows_replayed"] >= 2 * 17, c
    same, compared = same_drafts(run, stock_run)
    assert compared >= 2 * 10 and compared == len(stock_run["drafts"]), (compared, len(stock_run["drafts"]))
    assert same == compared, f"{compared - same} of {compared} tail drafts differ from vLLM's own KV sync"
    assert run["tokens"] == stock_run["tokens"] and run["sampled"] == stock_run["sampled"]


def test_holes_in_the_draft_kv_would_be_seen(tiny_model, drafter, stock):
    draft, parallel = drafter
    planted = tail_run(tiny_model, draft, plant=PLANT_HOLES, parallel=parallel)
    same, compared = same_drafts(planted, stock)
    assert planted["tokens"] == stock["tokens"]  # lossless either way: only the drafts suffer
    assert same < compared, "dropping the held rows went unnoticed: the comparison cannot fail"


def test_a_parallel_drafter_is_deferred_only_where_its_mask_slots_leave_room_for_a_batch():
    """The replay pass carries a parallel drafter's mask slots too, in buffers of ``max_num_tokens``
    rows: the stash holds that many rows fewer, and a configuration without room for one full batch
    keeps vLLM's own pass (a stash of fewer than one row could not even be built)."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    from vllm_specrl.cpu.deferred_draft_kv import DeferredDraftKV

    drafter = object.__new__(SpecDecodeBaseProposer)
    vars(drafter).update(method="eagle3", parallel_drafting=True, needs_extra_input_slots=True,
                         net_num_new_slots_per_request=2, max_batch_size=64, max_num_tokens=2048,
                         uses_mrope=False, supports_mm_inputs=False)
    assert DeferredDraftKV.stash_rows(drafter) == 2048 - 2 * 64
    assert DeferredDraftKV.eligible(drafter)
    drafter.max_num_tokens = 3 * 64 - 1
    assert not DeferredDraftKV.eligible(drafter)
    # Extra input slots of another kind (not a parallel drafter's mask slots) are never deferred.
    vars(drafter).update(parallel_drafting=False, max_num_tokens=2048)
    assert not DeferredDraftKV.eligible(drafter)
    vars(drafter).update(needs_extra_input_slots=False, net_num_new_slots_per_request=0)
    assert DeferredDraftKV.stash_rows(drafter) == 2048 and DeferredDraftKV.eligible(drafter)
