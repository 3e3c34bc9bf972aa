"""Check every vLLM internal that ``vllm_specrl.vllm_compat`` touches against a vLLM source tree.

Reads source only (``ast``), so a vLLM that cannot run here (the CUDA wheel of a
newer release) can still be checked: download it with
``pip download vllm==0.33.0 --no-deps`` and pass the wheel. Each touch point is
compared with the installed (reference) vLLM: a function's parameters, a class's
methods, the attributes a class assigns on ``self``, a module's names. Output:
one line per touch point (same / changed / missing) and a JSON file.

    python scripts/check_vllm_touch_points.py --wheel vllm-0.33.0-...whl --out docs/vllm_0.33.0_touch_points.json
"""

from __future__ import annotations

import argparse
import ast
import atexit
import json
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

# (file under vllm/, dotted name, kind, used for). kinds: "function" (parameters), "class"
# (exists), "attrs:<a,b>" (assigned on self somewhere in the class, or dataclass fields),
# "names:<a,b>" (module-level names).
TOUCH_POINTS: list[tuple[str, str, str, str]] = [
    ("v1/worker/gpu_model_runner.py", "GPUModelRunner.execute_model", "function", "capture tap, step timer, phase timers"),
    ("v1/worker/gpu_model_runner.py", "GPUModelRunner.sample_tokens", "function", "capture tap, seeded rewind, step timer"),
    ("v1/worker/gpu_model_runner.py", "GPUModelRunner.propose_draft_token_ids", "function",
     "capture tap, draft recorder, custom_class proposer binding, deferred draft-KV sync (held before its inputs)"),
    ("v1/worker/gpu_model_runner.py", "GPUModelRunner._get_positions", "function",
     "deferred draft-KV sync: a held step's positions"),
    ("v1/worker/gpu_model_runner.py", "GPUModelRunner", "attrs:use_aux_hidden_state_outputs,"
     "valid_sampled_token_count_event,speculative_config", "deferred draft-KV sync: where a step is held before "
     "vLLM gathers the drafter's inputs"),
    ("v1/spec_decode/metadata.py", "SpecDecodeMetadata", "attrs:max_spec_len",
     "deferred draft-KV sync: a step that verified no drafts"),
    ("config/speculative.py", "SpeculativeConfig", "attrs:disable_padded_drafter_batch",
     "deferred draft-KV sync: held before vLLM's inputs on the padded-batch path only"),
    ("v1/spec_decode/custom_class_proposer.py", "create_custom_proposer", "function",
     "history proposer (custom_class: constructed with vllm_config, propose(token rows))"),
    ("v1/worker/gpu_model_runner.py", "GPUModelRunner.reload_weights", "function", "in-place policy updates"),
    ("v1/worker/gpu_model_runner.py", "GPUModelRunner.get_model", "function", "worker status, tied head"),
    ("v1/worker/gpu_model_runner.py", "GPUModelRunner", "attrs:drafter,input_batch,execute_model_state,"
     "query_start_loc,input_ids,positions,discard_request_mask,_draft_probs,_draft_prob_req_ids,sampler,"
     "rejection_sampler,requests", "runner state the tap, recorder and timers read"),
    ("v1/worker/gpu_model_runner.py", "ExecuteModelState", "attrs:logits", "sampled tokens' logprobs"),
    ("v1/worker/cpu_model_runner.py", "CPUModelRunner", "class", "CPU-only patches (rewind, step timer)"),
    ("v1/worker/gpu_input_batch.py", "InputBatch", "attrs:req_ids,num_reqs,num_prompt_tokens,generators,"
     "num_tokens_no_spec,token_ids_cpu", "capture view, seeded rewind"),
    ("v1/core/sched/scheduler.py", "Scheduler.schedule", "function", "adaptive k"),
    ("v1/core/sched/scheduler.py", "Scheduler.update_from_output", "function", "adaptive k"),
    ("v1/core/sched/scheduler.py", "Scheduler", "attrs:dynamic_sd_lookup,num_spec_tokens,scheduler_config",
     "adaptive k rewrites the k table"),
    ("v1/core/sched/async_scheduler.py", "AsyncScheduler", "class", "adaptive k (async engines)"),
    ("v1/engine/core.py", "EngineCore.post_step", "function", "no draft fetch after a step that asked for none"),
    ("v1/engine/core.py", "EngineCore", "attrs:scheduler,async_scheduling,vllm_config,batch_queue",
     "no draft fetch after a step that asked for none"),
    ("v1/engine/llm_engine.py", "LLMEngine", "attrs:engine_core", "bench_rollout --phases: the in-process scheduler"),
    ("v1/engine/core_client.py", "InprocClient", "attrs:engine_core", "bench_rollout --phases: the in-process scheduler"),
    ("v1/core/sched/output.py", "SchedulerOutput", "attrs:num_spec_tokens_to_schedule,scheduled_spec_decode_tokens,"
     "num_scheduled_tokens,scheduled_new_reqs", "adaptive k reads each step's shape"),
    ("v1/outputs.py", "ModelRunnerOutput", "attrs:req_ids,req_id_to_index,sampled_token_ids",
     "adaptive k acceptance; step timer attribute"),
    ("v1/spec_decode/llm_base_proposer.py", "compute_probs_and_sample_next_token", "function",
     "CPU fast draft sampling"),
    ("v1/spec_decode/llm_base_proposer.py", "SpecDecodeBaseProposer._sample_draft_tokens", "function",
     "phase timers; CPU draft sampling in the draft's own vocabulary"),
    ("v1/spec_decode/llm_base_proposer.py", "SpecDecodeBaseProposer", "attrs:_enable_probabilistic_draft_probs,"
     "use_heterogeneous_vocab,use_fp64_gumbel", "CPU draft sampling in the draft's own vocabulary"),
    ("model_executor/models/llama_eagle3.py", "Eagle3LlamaForCausalLM", "attrs:draft_id_to_target_id,"
     "logits_processor,lm_head,config", "CPU draft sampling in the draft's own vocabulary"),
    ("v1/spec_decode/llm_base_proposer.py", "SpecDecodeBaseProposer.propose", "function",
     "deferred draft-KV sync at k = 0 (keyword call, replay pass)"),
    ("v1/spec_decode/llm_base_proposer.py", "SpecDecodeBaseProposer", "attrs:parallel_drafting,"
     "parallel_drafting_hidden_state_tensor,eagle3_use_aux_hidden_state",
     "P-EAGLE drafts: mask-slot state refreshed after a draft update"),
    ("model_executor/models/llama_eagle3.py", "Eagle3LlamaForCausalLM.combine_hidden_states", "function",
     "P-EAGLE drafts: mask-slot state refreshed after a draft update"),
    ("v1/spec_decode/llm_base_proposer.py", "SpecDecodeBaseProposer", "attrs:method,max_num_tokens,"
     "num_speculative_tokens,_last_draft_probs,needs_extra_input_slots,net_num_new_slots_per_request,"
     "max_batch_size,uses_mrope,supports_mm_inputs,"
     "parallel_drafting", "deferred draft-KV sync: eligibility, the stash bound, the k = 0 return"),
    ("v1/attention/backend.py", "CommonAttentionMetadata", "attrs:query_start_loc,query_start_loc_cpu,seq_lens,"
     "seq_lens_cpu_upper_bound,num_reqs,num_actual_tokens,max_query_len,max_seq_len,block_table_tensor,"
     "slot_mapping,causal", "deferred draft-KV sync builds the replay pass's metadata"),
    ("v1/sample/rejection_sampler.py", "sample_recovered_tokens", "function", "CPU fast recovered sampling"),
    ("v1/sample/rejection_sampler.py", "rejection_sample", "function",
     "CPU lazy recovery (sampled batches) and the fast-sampling tests"),
    ("v1/sample/rejection_sampler.py", "generate_uniform_probs", "function", "CPU lazy recovery: acceptance draws"),
    ("v1/sample/rejection_sampler.py", "RejectionSampler._get_logprobs_tensors", "function",
     "CPU logprobs of emitted rows only"),
    ("v1/sample/rejection_sampler.py", "RejectionSampler", "attrs:sampler,is_logits_logprobs_mode",
     "CPU logprobs of emitted rows only"),
    ("v1/sample/rejection_sampler.py", "RejectionSampler.forward", "function", "CPU one-pass verify"),
    ("v1/sample/rejection_sampler.py", "RejectionSampler", "attrs:synthetic_mode", "CPU one-pass verify"),
    ("v1/sample/sampler.py", "Sampler.gather_logprobs", "function", "CPU one-pass verify: logprobs and ranks"),
    ("v1/sample/sampler.py", "Sampler.compute_logprobs", "function",
     "capture tap: the step's log-softmax kept for its scoring (instance override)"),
    ("v1/sample/metadata.py", "SamplingMetadata", "attrs:all_random,top_p,top_k,no_penalties,bad_words_token_ids,"
     "allowed_token_ids_mask,logprob_token_ids,max_num_logprobs,temperature,logitsprocs,"
     "thinking_budget_state_holder", "CPU one-pass verify: the batches it serves"),
    ("v1/sample/logits_processor/builtin.py", "MinPLogitsProcessor", "attrs:min_p_count",
     "CPU one-pass verify: idle built-in processors"),
    ("v1/sample/logits_processor/builtin.py", "LogitBiasLogitsProcessor", "attrs:biases",
     "CPU one-pass verify: idle built-in processors"),
    ("v1/sample/logits_processor/builtin.py", "MinTokensLogitsProcessor", "attrs:min_toks",
     "CPU one-pass verify: idle built-in processors"),
    ("model_executor/model_loader/reload/inplace.py", "reload_weights", "function",
     "in-place draft updates, the MTP drafter on policy updates"),
    ("model_executor/models/mimo_mtp.py", "MiMoMTP.load_weights", "function",
     "policy updates reach the MTP drafter (it keeps its own tensors of the full set)"),
    ("config/speculative.py", "SpeculativeConfig", "attrs:method,num_speculative_tokens_per_batch_size",
     "MTP drafter detection; bench_step_cost --held-at"),
    ("model_executor/model_loader/reload/layerwise.py", "initialize_layerwise_reload", "function", "shm engine"),
    ("model_executor/model_loader/reload/layerwise.py", "finalize_layerwise_reload", "function", "shm engine"),
    ("utils/cpu_triton_utils.py", "_expand_kernel_impl", "function", "CPU expand-kernel fix"),
    ("triton_utils/dispatcher.py", "", "names:_registry,register_kernels", "re-register the fixed kernel"),
    ("distributed/weight_transfer/base.py", "WeightTransferEngine", "class", "specrl_shm backend"),
    ("v1/engine/async_llm.py", "AsyncLLM.pause_generation", "function", "pause around commits"),
    ("v1/engine/async_llm.py", "AsyncLLM.resume_generation", "function", "pause around commits"),
    ("v1/engine/async_llm.py", "AsyncLLM.reset_prefix_cache", "function", "KV reset after a commit"),
    ("v1/engine/async_llm.py", "AsyncLLM.collective_rpc", "function", "every /specrl route"),
    ("v1/engine/async_llm.py", "AsyncLLM.errored", "function", "calls fail when the engine core dies"),
    ("platforms/cpu.py", "CpuPlatform.check_and_update_config", "function",
     "VLLM_SPECRL_CPU_START_METHOD (it sets VLLM_WORKER_MULTIPROC_METHOD=spawn)"),
    ("plugins/__init__.py", "", "names:plugins_loaded,load_general_plugins", "plugin reloaded in a forked child"),
]


@dataclass
class Found:
    status: str            # "ok" or "missing"
    signature: list[str]   # parameters, methods or attributes found (sorted where a set)


def parse(root: Path, rel: str) -> ast.Module | None:
    path = root / "vllm" / rel
    return ast.parse(path.read_text()) if path.exists() else None


def find(tree: ast.AST, dotted: str) -> ast.AST | None:
    node: ast.AST | None = tree
    for part in dotted.split("."):
        body = getattr(node, "body", [])
        node = next((n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == part), None)
        if node is None:
            return None
    return node


def params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Parameter names; ``name=`` where it has a default."""
    a = fn.args
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    out = [p.arg + ("=" if i >= first_default else "") for i, p in enumerate(positional)]
    out += [f"*{a.vararg.arg}"] if a.vararg else []
    out += [f"{p.arg}=" if d is not None else p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    out += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return out


def class_attrs(cls: ast.ClassDef) -> set[str]:
    names = {t.target.id for t in cls.body if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}
    names |= {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}  # properties
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                    names.add(el.attr)
    if any(isinstance(b, ast.Name) and b.id == "NamedTuple" for b in cls.bases):
        names |= {t.target.id for t in cls.body if isinstance(t, ast.AnnAssign)}
    return names


def check(root: Path, rel: str, dotted: str, kind: str) -> Found:
    tree = parse(root, rel)
    if tree is None:
        return Found("missing", [f"no file vllm/{rel}"])
    if kind.startswith("names:"):
        defined = {t.id for n in tree.body for t in (n.targets if isinstance(n, ast.Assign) else
                   [n.target] if isinstance(n, ast.AnnAssign) else []) if isinstance(t, ast.Name)}
        defined |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        wanted = kind.split(":", 1)[1].split(",")
        missing = [w for w in wanted if w not in defined]
        return Found("missing" if missing else "ok", sorted(set(wanted) - set(missing)))
    if kind == "method-anywhere":
        hits = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and n.name == dotted]
        return Found("ok", params(hits[0])) if hits else Found("missing", [])
    node = find(tree, dotted)
    if node is None:
        return Found("missing", [])
    if kind == "function":
        return Found("ok", params(node))
    if kind == "class":
        return Found("ok", sorted(n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))))
    wanted = kind.split(":", 1)[1].split(",")
    have = class_attrs(node)
    missing = [w for w in wanted if w not in have]
    return Found("missing" if missing else "ok", sorted(set(wanted) - set(missing)))


def source_root(wheel: Path | None, tree: Path | None) -> tuple[Path, str]:
    if tree:
        return tree, "source tree"
    if wheel:
        out = Path(tempfile.mkdtemp(prefix="vllm-src-"))
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    zf.extract(name, out)
        return out, wheel.name
    import vllm

    return Path(vllm.__file__).parents[1], f"installed {vllm.__version__}"


def version_of(root: Path) -> str:
    import re

    path = root / "vllm" / "_version.py"
    found = re.search(r"""^__version__\s*=.*?['"]([^'"]+)['"]""", path.read_text() if path.exists() else "", re.M)
    return found.group(1) if found else "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel", type=Path, help="a vLLM wheel to read (not installed)")
    ap.add_argument("--tree", type=Path, help="a directory holding vllm/ sources")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    ref_root, ref_name = source_root(None, None)
    new_root, new_name = source_root(args.wheel, args.tree)
    rows, failures = [], 0
    for rel, dotted, kind, used_for in TOUCH_POINTS:
        ref, new = check(ref_root, rel, dotted, kind), check(new_root, rel, dotted, kind)
        if new.status == "missing":
            verdict = "missing"
        elif ref.status == "ok" and kind == "function" and new.signature != ref.signature:
            added = new.signature[len(ref.signature):]
            extended = new.signature[:len(ref.signature)] == ref.signature and all(p.endswith("=") for p in added)
            verdict = "extended (defaulted params)" if extended else "changed"
        else:
            verdict = "same" if new.signature == ref.signature else "same (touched names present)"
        failures += verdict in ("missing", "changed")
        rows.append({"file": f"vllm/{rel}", "name": dotted or kind, "kind": kind.split(":")[0], "used_for": used_for,
                     "verdict": verdict, "reference": ref.signature if kind == "function" else None,
                     "checked": new.signature if kind == "function" or new.status == "missing" else None})
        print(f"{verdict:28s} vllm/{rel}::{dotted or kind}")
        if verdict == "changed":
            print(f"{'':28s}   {ref.signature}\n{'':28s} ->{new.signature}")
    report = {"reference": {"what": ref_name, "version": version_of(ref_root)},
              "checked": {"what": new_name, "version": version_of(new_root)},
              "touch_points": len(rows), "missing_or_changed": failures, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{len(rows)} touch points, {failures} missing or changed "
          f"({report['checked']['version']} vs {report['reference']['version']})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
