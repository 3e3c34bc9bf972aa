"""Deferred draft-KV sync: an EAGLE drafter's k = 0 passes held and replayed in one pass when drafts resume.

vLLM 0.32's EAGLE drafter (``SpecDecodeBaseProposer.propose``) runs its first pass
on every step, also at k = 0 (adaptive k, or ``num_speculative_tokens_per_batch_size``),
"to keep the drafter KV cache in sync", then returns no drafts, a cost
``bench_step_cost.py --held-at 0`` measures. Wrapped per drafter
(instance attribute over the class method, attached on the runner's first
``propose_draft_token_ids``): a k = 0 step whose requests all decode one token
(``max_query_len == 1``) stores the pass's inputs (``cpu.draft_kv_stash``)
and returns the same empty draft tensor. A k = 0 step that mixes prompt chunks with
one-token decodes (a request joining a running batch, which in a refilled rollout batch happens every
few steps) holds the
decodes' rows too and passes the prompt chunks alone (the prompt's draft KV is written at
once). The stash holds ``STASH_PASSES`` drafter passes' worth of rows (``drafter.max_num_tokens``
each); a full one first forgets the rows of requests that left the batch. Before any other call
(k > 0, a resumed request, or the stash still full) the held rows of the requests still in the
batch are written by stock ``propose(0, ...)`` passes (at most ``drafter.max_num_tokens`` rows
each, in position order), each over a
``CommonAttentionMetadata`` of just those rows (query = the held positions,
``seq_lens`` = the current step's first position, block-table rows of the batch,
the held KV slots). Inputs are passed so that ``set_inputs_first_pass``'s shift
reproduces each skipped pass's input ids (``target_token_ids`` = held ids rolled
right by one, ``next_token_ids`` = each request's last held id). Drafts are still
verified by the target, so this changes cost only; requests that finish at k = 0
never pay the pass. Eligible: ``eagle``/``eagle3`` without M-RoPE or multimodal
inputs, and without extra input slots unless they are a parallel drafter's mask
slots: its every pass, the replay's too, appends ``net_num_new_slots_per_request``
mask rows after each request's rows, at positions the next pass writes again, so
the replay leaves the same entries at every position a later pass reads (the stash
holds that many rows per batch slot fewer, for the drafter's buffers; where that
leaves no room for a full batch, vLLM's own pass runs).
Such a k = 0 step of one-token decodes is held before vLLM gathers the drafter's inputs
(``GPUModelRunner.propose_draft_token_ids`` wrapped: its per-request backup-token loop and
next-token kernel are work for a pass that is not run), on
the padded-batch path without async scheduling, where that gathering does nothing else.
``VLLM_SPECRL_DEFER_DRAFT_KV=0`` keeps vLLM's path. Scope: CPU (a GPU would pay a host sync per
k = 0 step for the held positions, never measured).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from vllm_specrl.compat.engine_config import runner_drafter
from vllm_specrl.compat.registry import REGISTRY, Patch
from vllm_specrl.proposer.custom_binding import DEFERRED_KV_ORDER
from vllm_specrl.cpu.draft_kv_stash import DraftKVStash

DEFER_DRAFT_KV_ENV = "VLLM_SPECRL_DEFER_DRAFT_KV"
_PROPOSE_PARAMETERS = ["self", "num_speculative_tokens", "target_token_ids", "target_positions",
                       "target_hidden_states", "next_token_ids", "token_indices_to_sample",
                       "common_attn_metadata", "sampling_metadata", "mm_embed_inputs",
                       "num_rejected_tokens_gpu", "slot_mappings"]


def _signature_names(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


# Drafter passes' worth of rows the stash holds before a full stash replays. A replay is the draft-KV
# upkeep for requests still running; a request that finishes before drafting resumes never pays it, so
# the larger the stash, the more of it is skipped where k stays at 0 (long answers at a batch size where
# no k pays). Memory: rows x (3 x hidden for EAGLE-3) x dtype, e.g. 8 x 2048 rows at hidden size 576 in bf16 ~ 57 MiB.
STASH_PASSES = 8

_RUNNER_PROPOSE_PARAMETERS = ["self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
                              "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata",
                              "common_attn_metadata", "slot_mappings"]


class DeferredDraftKV:
    """One drafter's k = 0 passes, deferred (see above)."""

    def __init__(self, runner: Any, drafter: Any):
        self.runner, self.drafter = runner, drafter
        # vLLM's input gathering is skipped only where it does nothing else: the padded-batch path
        # (sampled tokens as a tensor), no async scheduling (its sampled-count copy), the target's
        # hidden states as they are (no model hook that replaces them).
        config = runner.speculative_config
        self.holds_early = (not config.disable_padded_drafter_batch
                            and getattr(runner, "valid_sampled_token_count_event", None) is None
                            and not hasattr(runner.get_model(), "get_mtp_target_hidden_states"))
        self._empty_drafts: dict[tuple[int, Any], Any] = {}
        self.pass_rows = self.stash_rows(drafter)
        self.stash = DraftKVStash(self.pass_rows * STASH_PASSES)

    @classmethod
    def attach(cls, runner: Any, drafter: Any) -> DeferredDraftKV | None:
        """Defer this drafter's k = 0 passes: its ``propose`` wrapped on the drafter itself (a registry
        patch on that object); None where it is not eligible or the patch does not apply."""
        if not cls.eligible(drafter):
            return None
        deferral = cls(runner, drafter)

        def wrap(stock: Any) -> Any:
            deferral.stock_propose = stock
            return deferral.propose

        return deferral if REGISTRY.install(DEFERRED_KV_PROPOSE_PATCH, wrap, on=drafter) == "installed" else None

    @staticmethod
    def stash_rows(drafter: Any) -> int:
        """Rows one replay pass may carry (the stash holds ``STASH_PASSES`` times as many): the
        drafter's buffers hold ``max_num_tokens`` rows, and a parallel drafter's pass also carries its
        mask slots after each request's rows."""
        mask_slots = (int(drafter.net_num_new_slots_per_request) * int(drafter.max_batch_size)
                      if drafter.needs_extra_input_slots else 0)
        return int(drafter.max_num_tokens) - mask_slots

    @staticmethod
    def eligible(drafter: Any) -> bool:
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

        parallel = bool(getattr(drafter, "parallel_drafting", False))
        return (isinstance(drafter, SpecDecodeBaseProposer) and getattr(drafter, "method", None) in ("eagle", "eagle3")
                and (parallel or not getattr(drafter, "needs_extra_input_slots", True))
                and not getattr(drafter, "uses_mrope", True) and not getattr(drafter, "supports_mm_inputs", True)
                # room for at least a full batch's step (else vLLM's own pass every step)
                and DeferredDraftKV.stash_rows(drafter) >= int(drafter.max_batch_size))

    def propose(self, **kw: Any) -> Any:
        attention = kw["common_attn_metadata"]
        n = attention.num_reqs
        req_ids = self.runner.input_batch.req_ids[:n]
        if kw["num_speculative_tokens"] == 0 and attention.max_query_len == 1 and attention.num_actual_tokens == n:
            self._make_room(n, attention, req_ids, kw)
            if self.stash.fits(n):
                positions = kw["target_positions"][:n]
                self.stash.add_step(list(req_ids), positions.tolist(), kw["next_token_ids"], positions,
                                    kw["target_hidden_states"], attention.slot_mapping)
                return self._no_drafts(n, kw["next_token_ids"].device)
        elif kw["num_speculative_tokens"] == 0 and self._defer_decodes_beside_prefills(attention, req_ids, kw):
            return self._no_drafts(n, kw["next_token_ids"].device)
        if self.stash.rows:
            self.replay(attention, req_ids, kw)
        return self.stock_propose(**kw)

    def hold_before_vllm_inputs(self, scheduler_output: Any, sampled_token_ids: Any, sampling_metadata: Any,
                                hidden_states: Any, sample_hidden_states: Any, aux_hidden_states: Any,
                                spec_decode_metadata: Any, attention: Any, slot_mappings: Any) -> Any:
        """A k = 0 step of one-token decodes that the stash can hold, held before vLLM gathers the
        drafter's inputs (its Python loop over the batch for backup tokens, the next-token kernel,
        the hidden-state concatenation: work for a pass that is not run). The rows are what ``propose``
        would hold: every request decoded one token at k = 0,
        none is discarded (a partial prompt), none verified drafts (vLLM's spec-decode metadata, when
        there is one, has none), so each one's next token is its one sampled token. None (nothing
        done) for any other step. Arguments: ``propose_draft_token_ids``'s."""
        import torch

        runner, n = self.runner, attention.num_reqs
        if (scheduler_output.num_spec_tokens_to_schedule != 0
                or (spec_decode_metadata is not None and spec_decode_metadata.max_spec_len != 0)
                or attention.max_query_len != 1 or attention.num_actual_tokens != n or not self.stash.fits(n)
                or not isinstance(sampled_token_ids, torch.Tensor) or sampled_token_ids.shape[1] != 1
                or runner.discard_request_mask.np[:n].any()):
            return None
        positions = runner._get_positions(n)
        hidden = (torch.cat([h[:n] for h in aux_hidden_states], dim=-1) if runner.use_aux_hidden_state_outputs
                  else hidden_states[:n])
        self.stash.add_step(list(runner.input_batch.req_ids[:n]), positions.tolist(),
                            sampled_token_ids[:n, 0].to(torch.int32), positions, hidden, attention.slot_mapping,
                            hidden_states_owned=runner.use_aux_hidden_state_outputs)
        self.stash.counters.held_early += 1
        runner._draft_probs = runner._draft_prob_req_ids = None
        return self._no_drafts(n, sampled_token_ids.device)

    def _make_room(self, rows: int, attention: Any, req_ids: list[str], kw: dict[str, Any]) -> None:
        """Room for ``rows`` more: first forget the rows of requests that left the batch (never
        replayed: their draft KV is never read), and replay the batch's only if still full."""
        if self.stash.fits(rows):
            return
        self.stash.forget_absent(list(req_ids))
        if not self.stash.fits(rows):
            self.replay(attention, req_ids, kw)

    def _no_drafts(self, n: int, device: Any) -> Any:
        import torch

        self.drafter.num_speculative_tokens = 0
        self.drafter._last_draft_probs = None
        key = (n, device)
        empty = self._empty_drafts.get(key)  # an (n, 0) tensor has nothing to write into: shared
        if empty is None:
            empty = self._empty_drafts[key] = torch.empty(n, 0, dtype=torch.int64, device=device)
        return empty

    def _defer_decodes_beside_prefills(self, attention: Any, req_ids: list[str], kw: dict[str, Any]) -> bool:
        """A k = 0 step that mixes prompt chunks with one-token decodes (a request joining a running
        batch): hold the decodes' rows, and run the stock pass over the prompt chunks alone, instead
        of replaying everything held and passing over the whole batch (with requests joining
        continuously, as in a refilled rollout batch, that replayed most held rows every few steps).
        False (nothing done) for any other shape: a request that verified drafts, or resumed."""
        import torch

        starts_at = attention.query_start_loc_cpu.long()
        query_lens = (starts_at[1:] - starts_at[:-1]).tolist()
        tokens = attention.num_actual_tokens
        if tokens != int(starts_at[-1]) or int(kw["target_token_ids"].shape[0]) < tokens:
            return False
        first = kw["target_positions"][starts_at[:-1]].tolist()
        prompt_lens = self.runner.input_batch.num_prompt_tokens[:len(query_lens)].tolist()
        prompts, decodes = [], []
        for i, (q, pos, plen) in enumerate(zip(query_lens, first, prompt_lens)):
            if pos + q <= plen:
                prompts.append(i)
            elif q == 1:
                decodes.append(i)
            else:
                return False
        if not prompts or not decodes:
            return False
        self._make_room(len(decodes), attention, req_ids, kw)
        if not self.stash.fits(len(decodes)):
            return False
        dev = kw["target_positions"].device
        rows = torch.tensor([int(starts_at[i]) for i in decodes], dtype=torch.long, device=dev)
        idx = torch.tensor(decodes, dtype=torch.long, device=dev)
        positions = kw["target_positions"].index_select(0, rows)
        self.stash.add_step([req_ids[i] for i in decodes], positions.tolist(),
                            kw["next_token_ids"].index_select(0, idx), positions,
                            kw["target_hidden_states"].index_select(0, rows),
                            attention.slot_mapping.index_select(0, rows))
        self.stash.counters.prompt_passes += 1
        chunk_rows = torch.cat([torch.arange(int(starts_at[i]), int(starts_at[i + 1])) for i in prompts]).to(dev)
        sub_cam = self._sub_batch_metadata(
            attention, prompts, [query_lens[i] for i in prompts], attention.seq_lens[prompts].tolist(),
            attention.slot_mapping.index_select(0, chunk_rows), kw["next_token_ids"].device)
        self.stock_propose(
            num_speculative_tokens=0, target_token_ids=kw["target_token_ids"].index_select(0, chunk_rows),
            target_positions=kw["target_positions"].index_select(0, chunk_rows),
            target_hidden_states=kw["target_hidden_states"].index_select(0, chunk_rows),
            next_token_ids=kw["next_token_ids"].index_select(0, torch.tensor(prompts, device=dev)),
            token_indices_to_sample=(sub_cam.query_start_loc[1:] - 1), common_attn_metadata=sub_cam,
            sampling_metadata=kw["sampling_metadata"], mm_embed_inputs=None, num_rejected_tokens_gpu=None,
            slot_mappings=None)
        return True

    @staticmethod
    def _sub_batch_metadata(attention: Any, batch_rows: list[int], query_lens: list[int], seq_lens: list[int],
                            slots: Any, device: Any) -> Any:
        """Attention metadata of a pass over some of the batch's requests (their block-table rows),
        ``query_lens[i]`` rows each, ending at KV length ``seq_lens[i]``, written at ``slots``."""
        import torch
        from vllm.v1.attention.backend import CommonAttentionMetadata

        qsl_cpu = torch.zeros(len(query_lens) + 1, dtype=attention.query_start_loc_cpu.dtype)
        torch.cumsum(torch.tensor(query_lens), 0, out=qsl_cpu[1:])
        seq_lens_cpu = torch.tensor(seq_lens, dtype=attention.seq_lens.dtype)
        rows = torch.tensor(batch_rows, dtype=torch.long, device=attention.block_table_tensor.device)
        return CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(device), query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_lens_cpu.to(device), seq_lens_cpu_upper_bound=seq_lens_cpu,
            num_reqs=len(batch_rows), num_actual_tokens=int(qsl_cpu[-1]),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            block_table_tensor=attention.block_table_tensor.index_select(0, rows),
            slot_mapping=slots.to(device), causal=True)

    def replay(self, attention: Any, req_ids: list[str], kw: dict[str, Any]) -> None:
        """Write the held rows of the batch's requests into the draft KV cache (stock passes of at
        most one pass's rows each, in order)."""
        starts = kw["target_positions"][attention.query_start_loc_cpu[:-1].long()].tolist()
        plan = self.stash.take(list(req_ids), starts)
        if plan is None:
            return
        for part in plan.passes(self.pass_rows):
            self._replay_pass(part, attention, kw)
            self.stash.counters.replay_passes += 1

    def _replay_pass(self, plan: Any, attention: Any, kw: dict[str, Any]) -> None:
        import torch

        device = kw["next_token_ids"].device
        replay_cam = self._sub_batch_metadata(attention, plan.batch_rows, plan.query_lens, plan.seq_lens,
                                              plan.slots, device)
        last = replay_cam.query_start_loc[1:] - 1
        token_ids = plan.token_ids.to(device)
        self.stock_propose(
            num_speculative_tokens=0, target_token_ids=torch.roll(token_ids, 1),
            target_positions=plan.positions.to(device), target_hidden_states=plan.hidden_states.to(device),
            next_token_ids=token_ids[last.long()], token_indices_to_sample=last,
            common_attn_metadata=replay_cam, sampling_metadata=kw["sampling_metadata"],
            mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None)


DEFERRED_KV_PATCH = REGISTRY.declare(Patch(shortcut=True,
    name="deferred_draft_kv",
    target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
    why="the drafter's k = 0 passes are held and replayed in a few passes when drafts resume, drafts unchanged "
        "(CPU step cost: benchmarks, bench_step_cost --held-at 0)",
    scope="cpu", switch=DEFER_DRAFT_KV_ENV, checked_on=("vLLM 0.32.0, CPU",), order=DEFERRED_KV_ORDER))
DEFERRED_KV_PROPOSE_PATCH = REGISTRY.declare(Patch(shortcut=True,
    name="deferred_draft_kv.propose", target="vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.propose",
    why="on each eligible drafter: a k = 0 pass of one-token decodes held, the held rows replayed in passes "
        "before the next pass that drafts (part of deferred_draft_kv)",
    scope="cpu", switch=DEFER_DRAFT_KV_ENV, checked_on=("vLLM 0.32.0, CPU",),
    signature=tuple(_PROPOSE_PARAMETERS[1:])))


def install_deferred_draft_kv() -> str:
    """Attach ``DeferredDraftKV`` to each eligible drafter on its runner's first proposal."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    if REGISTRY.is_installed(DEFERRED_KV_PATCH.name):
        return "installed"
    if _signature_names(SpecDecodeBaseProposer.propose) != _PROPOSE_PARAMETERS:
        return REGISTRY.skip(DEFERRED_KV_PATCH, "signature drift: SpecDecodeBaseProposer.propose is not the "
                             "method checked on 0.32.0")
    early_holds = []

    def wrap(stock):
        early = _signature_names(stock) == _RUNNER_PROPOSE_PARAMETERS
        early_holds.append(early)

        @functools.wraps(stock)
        def propose_draft_token_ids(self, *args, **kwargs):
            drafter = getattr(self, "drafter", None)
            if drafter is not None and "_specrl_deferred_kv" not in vars(drafter):
                drafter._specrl_deferred_kv = DeferredDraftKV.attach(self, drafter)
            deferral = getattr(drafter, "_specrl_deferred_kv", None)
            if early and deferral is not None and deferral.holds_early and not kwargs:
                drafts = deferral.hold_before_vllm_inputs(*args)
                if drafts is not None:
                    return drafts
            return stock(self, *args, **kwargs)
        return propose_draft_token_ids

    result = REGISTRY.install(DEFERRED_KV_PATCH, wrap)
    if result == "installed" and not early_holds[-1]:
        result += (" (k = 0 steps held inside vLLM's input gathering: propose_draft_token_ids is not the "
                   "method checked on 0.32.0)")
    return result


def deferred_draft_kv_counters(worker: Any) -> dict[str, int] | None:
    """The worker's deferred draft-KV counters (None when not attached)."""
    deferral = getattr(runner_drafter(worker), "_specrl_deferred_kv", None)
    return None if deferral is None else {**deferral.stash.counters.as_dict(), "rows_held": deferral.stash.rows}
