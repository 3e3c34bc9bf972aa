"""Rollouts from a ``vllm serve`` engine over the OpenAI completions API, with policy versions.

Each task's G samples are one request (``n=G``: vLLM shares the prompt's prefill);
every sample carries its prompt and completion token ids, vLLM's sampling logprobs
and the policy versions it was sampled under (the ``x-specrl-policy-version*``
response headers), and each request's finish time, which splits a step's generation
into its bulk (until half of the requests are done) and its tail (the rest).

``generate_at_lengths`` samples the same prompts again with every answer held to a given
length: the time another engine takes for the very lengths a run sampled, which compares
two engines' generation without the chance in how long their answers ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import requests


def sample_groups(url: str, model: str, prompts: list[str], group: int, max_tokens: int, seed: int,
                  step: int, score: Callable[[int, str], float],
                  timeout_s: float = 600, temperature: float = 1.0) -> tuple[list[dict], dict]:
    """G samples per prompt at ``temperature`` (RL samples at 1); returns (samples, timing).

    Every sample gets its own seed: vLLM seeds sample j of an ``n = G`` request with the
    request's seed + j, so prompt i's request is seeded ``seed + i * G`` (``seed + i`` gave
    prompt i's sample 1 and prompt i+1's sample 0 one random stream: rollouts of different
    prompts were correlated, which shrank the effective number of independent rewards).
    A caller's seeds for successive steps should be ``len(prompts) * group`` apart.

    ``score(i, text)`` is the reward of a completion of prompt ``i``. ``timing`` has
    ``generation_s`` (all requests), ``bulk_s`` (until half of them finished) and
    ``tail_s`` (the rest).
    """
    t0 = time.perf_counter()

    def one(i: int) -> tuple[list[dict], float]:
        r = requests.post(url + "/v1/completions", timeout=timeout_s, json={
            "model": model, "prompt": prompts[i], "n": group, "temperature": temperature,
            "max_tokens": max_tokens, "logprobs": 0, "return_token_ids": True, "seed": seed + i * group})
        r.raise_for_status()
        done = time.perf_counter() - t0
        start = int(r.headers["x-specrl-policy-version-start"])
        end = int(r.headers["x-specrl-policy-version"])
        return [{"rollout_id": f"{step}/{i}/{c['index']}", "prompt_ids": c["prompt_token_ids"],
                 "completion_ids": c["token_ids"], "text": c["text"],
                 "vllm_logprobs": c["logprobs"]["token_logprobs"], "reward": score(i, c["text"]),
                 "policy_version_start": start, "policy_version_end": end, "group": i}
                for c in sorted(r.json()["choices"], key=lambda c: c["index"])], done

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, range(len(prompts))))
    return [s for samples, _ in results for s in samples], bulk_and_tail(
        [done for _, done in results], time.perf_counter() - t0)


def bulk_and_tail(group_done_s: list[float], total_s: float) -> dict:
    """``generation_s``, ``bulk_s`` (until half of the prompt groups were done, a group when its last
    answer was) and ``tail_s`` (the rest): one rule for the loop's rollouts and their replay at the
    same lengths, so the two splits compare the same answers."""
    bulk = sorted(group_done_s)[(len(group_done_s) - 1) // 2]
    return {"generation_s": total_s, "bulk_s": bulk, "tail_s": total_s - bulk}


def generate_at_lengths(url: str, model: str, prompts: list[str], lengths: list[list[int]], seed: int,
                        timeout_s: float = 600) -> tuple[dict, list[list[int]]]:
    """Sample ``lengths[i][j]`` tokens for sample j of prompt i (T = 1, ``ignore_eos``), all at once.

    Returns (the timing ``sample_groups`` returns: all answers, and split where half of the prompts'
    groups were done, ``bulk_and_tail``; the lengths generated). A decode step's cost
    depends on how many sequences run and how long their contexts are, not on which tokens they
    hold, so this is what the engine would have taken for rollouts of exactly these lengths. Each
    sample is its own request (``n`` = 1: their lengths differ); vLLM fans an ``n = G`` request out
    into G sequences too, and its prefix cache shares the prompt's prefill among them either way.
    Requests ask for what ``sample_groups`` asks for (a sampled token's logprob, token ids).
    """
    jobs = [(i, j) for i, row in enumerate(lengths) for j in range(len(row))]
    t0 = time.perf_counter()

    def one(job: tuple[int, int]) -> tuple[int, float]:
        i, j = job
        r = requests.post(url + "/v1/completions", timeout=timeout_s, json={
            "model": model, "prompt": prompts[i], "n": 1, "temperature": 1.0, "max_tokens": lengths[i][j],
            "ignore_eos": True, "logprobs": 0, "return_token_ids": True, "seed": seed + i * len(lengths[i]) + j})
        r.raise_for_status()
        return len(r.json()["choices"][0]["token_ids"]), time.perf_counter() - t0

    with ThreadPoolExecutor(len(jobs)) as pool:
        produced = list(pool.map(one, jobs))
    total = time.perf_counter() - t0
    out: list[list[int]] = [[] for _ in lengths]
    group_done = [0.0 for _ in lengths]
    for (i, _), (n, done) in zip(jobs, produced):
        out[i].append(n)
        group_done[i] = max(group_done[i], done)
    return bulk_and_tail(group_done, total), out


def check_rollouts(samples: list[dict], step: int, tasks: int, group: int) -> None:
    """Every (task, sample) of this step exactly once: nothing lost, nothing counted twice."""
    want = {f"{step}/{i}/{j}" for i in range(tasks) for j in range(group)}
    got = [s["rollout_id"] for s in samples]
    if len(got) != len(set(got)) or set(got) != want:
        raise RuntimeError(f"step {step}: rollouts lost or duplicated: {sorted(set(got) ^ want)}")
