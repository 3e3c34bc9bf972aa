"""Sample many short continuations in a fresh engine and compare distributions.

Used by the losslessness tests: one engine per subprocess (vLLM allows one per
process), fixed seeds, and a two-sample chi-square test per output position.
"""

from __future__ import annotations

import json
from helpers import result_json, run_python
from vllm_specrl.selftest.stats import padded, per_position_pvalues  # noqa: F401 - the tests' too


def sample_continuations(model, prompt: str, num_samples: int, num_tokens: int,
                         temperature: float, seed: int, speculative_config: dict | None = None,
                         plugins: str = "specrl", dtype: str = "float32",
                         scheduler_cls: str | None = None, with_stats: bool = False,
                         group: int | None = None, max_num_seqs: int = 256,
                         stop_token_ids: list[int] | None = None):
    """``num_samples`` independent continuations of ``prompt`` (token ids); with ``with_stats``,
    also vLLM's own spec-decode counters for the run (``num_drafts``, ``num_accepted_tokens``).
    With ``stop_token_ids``: a sample ends at the first of them (kept, as vLLM returns it), so it
    may be shorter than ``num_tokens``.
    With ``group`` G: requests of ``n = G``, each seeded as an RL rollout client seeds them
    (request i: ``seed + i * G``, its sample j: vLLM's ``+ j``), so every sample is seeded."""
    if group:
        params = (f"[SamplingParams(temperature={temperature}, max_tokens={num_tokens}, ignore_eos=True, "
                  f"stop_token_ids={stop_token_ids!r}, n={group}, seed={seed} + i * {group}) "
                  f"for i in range({num_samples // group})]")
        prompts = f"[{prompt!r}] * {num_samples // group}"
    else:
        params = (f"SamplingParams(temperature={temperature}, max_tokens={num_tokens}, ignore_eos=True, "
                  f"stop_token_ids={stop_token_ids!r})")
        prompts = f"[{prompt!r}] * {num_samples}"
    out = run_python(f"""
        import json
        from vllm import LLM, SamplingParams
        llm = LLM(model={str(model)!r}, dtype={dtype!r}, enforce_eager=True, seed={seed},
                  max_model_len=512, max_num_seqs={max_num_seqs}, scheduler_cls={scheduler_cls!r},
                  disable_log_stats=False, speculative_config=json.loads({json.dumps(json.dumps(speculative_config))}))
        outs = llm.generate({prompts}, {params}, use_tqdm=False)
        stats = {{m.name.removeprefix("vllm:spec_decode_").removesuffix("_total"): getattr(m, "value", None)
                 for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num_")}}
        print("RESULT " + json.dumps({{"tokens": [list(c.token_ids) for o in outs for c in o.outputs],
                                       "stats": stats}}))
    """, env={"VLLM_PLUGINS": plugins})
    result = result_json(out)
    return (result["tokens"], result["stats"]) if with_stats else result["tokens"]


def describe(p: list[float]) -> str:
    return json.dumps([f"{x:.2e}" for x in p])


def greedy_generate(model, prompts: list[str], max_tokens: int,
                    speculative_config: dict | None = None, plugins: str = "specrl",
                    dtype: str = "float32", with_status: bool = False, with_text: bool = False,
                    scheduler_cls: str | None = None, max_num_seqs: int = 64,
                    additional_config: dict | None = None, compiled: bool = False) -> dict:
    """Greedy outputs (token ids and their logprobs) of a fresh engine; optional worker status.
    With ``scheduler_cls`` (adaptive k) the result also has the controller's published state.
    ``compiled``: vLLM's torch.compile mode, its default, instead of eager."""
    out = run_python(f"""
        import json
        from vllm import LLM, SamplingParams
        from vllm_specrl import metrics
        llm = LLM(model={str(model)!r}, dtype={dtype!r}, enforce_eager={not compiled}, seed=0,
                  max_model_len=512, max_num_seqs={max_num_seqs}, disable_log_stats=False,
                  scheduler_cls={scheduler_cls!r},
                  additional_config=json.loads({json.dumps(json.dumps(additional_config or {}))}),
                  speculative_config=json.loads({json.dumps(json.dumps(speculative_config))}),
                  worker_extension_cls="vllm_specrl.sync.SpecRLWorkerExtension" if {with_status} else "")
        params = SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True, logprobs=0)
        outs = llm.generate(json.loads({json.dumps(json.dumps(prompts))}), params, use_tqdm=False)
        res = {{"tokens": [list(o.outputs[0].token_ids) for o in outs],
                "logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                             for o in outs],
                "spec_decode": metrics.from_llm_metrics(llm.get_metrics()).summary()}}
        if {with_text}:
            res["texts"] = [o.outputs[0].text for o in outs]
        if {with_status}:
            res["worker"] = llm.collective_rpc("specrl_status")[0]
        if {scheduler_cls!r}:
            from vllm_specrl.adaptive import state
            res["adaptive_k"] = state.read()
        print("RESULT " + json.dumps(res))
    """, env={"VLLM_PLUGINS": plugins}, timeout=900 if compiled else 600)
    return result_json(out)
