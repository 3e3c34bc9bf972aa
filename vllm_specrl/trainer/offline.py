"""Offline warm start: train a draft on the target's own rollouts before RL starts.

1. generate rollouts from the target with vLLM (temperature 1, the RL setting), with the
   target's aux and final hidden states captured out of vLLM as it generates
   (``features="capture"``, the default: ``trainer.captured``), or computed afterwards by
   a transformers forward (``features="hf"``; always when ``--rollouts`` reuses saved ones);
2. train the draft with the EAGLE-3 loss and save it where vLLM loads it.

The paper's strongest result came from initialising the draft on in-domain
data (1.77x vs 1.51x with a general-chat draft); this is that step.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm import tqdm

from vllm_specrl.proposer.checkpoint import (
    TargetLayerMissing,
    init_draft,
    load_draft,
    start_from_target_layer,
    target_lm_head,
)
from vllm_specrl.proposer.eagle3_config import default_aux_layer_ids, default_mask_token_id, read_config
from vllm_specrl.trainer.core import TRAINER_STATE, DraftTrainer, TrainConfig, collate
from vllm_specrl.trainer.features import sequence_features
from vllm_specrl.trainer.rollout_seeds import per_prompt_sampling_params

DEFAULT_CHAT_PROMPTS = [
    "What is {a} + {b}? Answer with the number.",
    "Compute {a} times {b} and explain in one sentence.",
    "Write a Python function that returns the sum of a list of numbers.",
    "Give three tips for learning a new language.",
    "Explain what a prime number is, with an example bigger than {a}.",
    "Write a haiku about the number {a}.",
    "List the first {c} even numbers.",
    "Describe a cat in two sentences.",
]


ROLLOUTS = "warm_start_rollouts.json"
# Below this share of rollouts captured whole, the warm start computes every rollout's features with
# an HF forward instead of training on what the capture kept (a few dropped frames are left out).
MIN_CAPTURED_FRACTION = 0.9


@dataclass
class OfflineConfig:
    num_prompts: int = 64
    samples_per_prompt: int = 4
    max_tokens: int = 128
    temperature: float = 1.0
    steps: int = 300
    batch_size: int = 8
    eval_fraction: float = 0.1   # of the *prompts*: held-out rollouts never share a prompt with training
    eval_every: int = 0          # evaluate on the held-out prompts every N steps (the learning curve)
    seed: int = 0
    chat: bool = True
    dtype: str = "float32"
    task: str = "chat"           # prompt family when no prompts are given (TASK_PROMPTS)
    features: str = "capture"    # "capture": from vLLM while it generates; "hf": a transformers forward after
    group_by_length: bool = False  # batches of similar length (``length_grouped_batches``): less padding
    parallel_drafting: bool = False  # train for vLLM's parallel drafting (P-EAGLE; ``Eagle3Draft.make_parallel``)
    # A new draft's decoder layer starts from this target layer (-1: the last; None: random weights;
    # ``checkpoint.start_from_target_layer``).
    target_layer: int | None = -1
    # vLLM engine arguments for the engine that generates the rollouts, over the defaults below
    # (tensor_parallel_size, gpu_memory_utilization, dtype, max_model_len, ...).
    engine_args: dict = field(default_factory=dict)


# The RL demo's task family (scripts/rl_demo.py): small-number arithmetic, answered in a few
# tokens or, when asked to, with a worked explanation, so completion lengths vary as in RL.
ARITHMETIC_PROMPTS = [
    "What is {a} + {b}? Answer with just the number.",
    "What is {a} + {b}? Explain your reasoning step by step.",
    "A shop sells {a} apples in the morning and {b} in the afternoon. How many apples does it sell "
    "in total? Think step by step.",
    "Add {a} and {b}, then say whether the result is even or odd.",
]
TASK_PROMPTS = {"chat": DEFAULT_CHAT_PROMPTS, "arithmetic": ARITHMETIC_PROMPTS}
# ``explain``: the RL demo's default task itself (vllm_specrl.rl.tasks), its distinct prompts.
TASKS = (*TASK_PROMPTS, "explain")


def default_prompts(n: int, seed: int, task: str = "chat") -> list[str]:
    """``n`` prompts of a task family (``chat``: general requests; ``arithmetic``: the demo's
    family; ``explain``: the demo's own task, at most its 81 distinct prompts).
    Different seeds give different numbers: a held-out prompt set for the same family."""
    if task == "explain":
        from vllm_specrl.rl.tasks import distinct_prompts

        return distinct_prompts(n, seed, task)
    rng = random.Random(seed)
    templates = TASK_PROMPTS[task]
    out = []
    for i in range(n):
        template = templates[i % len(templates)]
        if task == "arithmetic":
            out.append(template.format(a=rng.randint(1, 20), b=rng.randint(1, 20)))
        else:
            out.append(template.format(a=rng.randint(2, 99), b=rng.randint(2, 99), c=rng.randint(3, 9)))
    return out


def prompt_texts(target_dir: Path, prompts: list[str], chat: bool) -> list[str]:
    """The prompts as the engine sees them (the target's chat template when ``chat``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    if chat and tok.chat_template:
        return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                        add_generation_prompt=True) for p in prompts]
    return list(prompts)


def generate_rollouts(target_dir: Path, prompts: list[str], cfg: OfflineConfig
                      ) -> tuple[list[list[int]], list[int], list[int]]:
    """Prompt + completion token ids of ``samples_per_prompt`` T=1 rollouts per prompt, with each
    rollout's prompt length and prompt index."""
    from vllm import LLM

    texts = prompt_texts(target_dir, prompts, cfg.chat)
    llm = LLM(**{"model": str(target_dir), "dtype": cfg.dtype, "enforce_eager": True, "seed": cfg.seed,
                 "max_model_len": 2048, **cfg.engine_args})
    params = per_prompt_sampling_params(len(texts), cfg.samples_per_prompt, cfg.temperature, cfg.max_tokens,
                                        cfg.seed)
    outs = llm.generate(texts, params)
    sequences, prompt_lengths, prompt_index = [], [], []
    for i, o in enumerate(outs):
        for c in o.outputs:
            sequences.append(list(o.prompt_token_ids) + list(c.token_ids))
            prompt_lengths.append(len(o.prompt_token_ids))
            prompt_index.append(i)
    del llm
    return sequences, prompt_lengths, prompt_index


def split_by_prompt(prompt_index: list[int], eval_fraction: float, seed: int) -> tuple[set[int], set[int]]:
    """(train, held-out) prompt indices: every rollout of a prompt lands on the same side."""
    prompts = sorted(set(prompt_index))
    random.Random(seed).shuffle(prompts)
    n_eval = max(1, round(len(prompts) * eval_fraction)) if len(prompts) > 1 else 0
    return set(prompts[n_eval:]), set(prompts[:n_eval])


@dataclass
class _Rollouts:
    """A warm start's data: the rollouts, their split by prompt, and their features when vLLM captured them."""

    prompts: list[str]
    sequences: list[list[int]]
    prompt_lengths: list[int]
    prompt_index: list[int]
    train_prompts: set[int]
    eval_prompts: set[int]
    features: list[dict] | None = None
    capture_counts: dict | None = None


def warm_start(target_dir: Path | str, draft_dir: Path | str, prompts: list[str] | None = None,
               cfg: OfflineConfig | None = None, train_cfg: TrainConfig | None = None,
               draft_vocab_size: int | None = None, init_from: Path | str | None = None,
               log_path: Path | str | None = None, rollouts_path: Path | str | None = None) -> dict:
    """Run the whole warm start: rollouts, the starting draft, features, training; returns a summary (also
    written next to the draft).

    ``rollouts_path``: reuse the rollouts (and held-out split) an earlier warm start saved
    (``warm_start_rollouts.json``) instead of generating new ones.
    """
    cfg = cfg or OfflineConfig()
    if cfg.features not in ("capture", "hf"):
        raise ValueError(f"features must be 'capture' or 'hf', not {cfg.features!r}")
    train_cfg = train_cfg or TrainConfig(seed=cfg.seed)
    target_dir, draft_dir = Path(target_dir), Path(draft_dir)
    aux_ids = (load_draft(init_from, target_dir).shape.aux_layer_ids if init_from else
               tuple(default_aux_layer_ids(read_config(target_dir)["num_hidden_layers"])))
    t0 = time.time()
    data = (_saved_rollouts(rollouts_path) if rollouts_path is not None
            else _new_rollouts(target_dir, prompts, cfg, aux_ids))
    t_gen = time.time() - t0
    draft, started_from = _starting_draft(target_dir, data, cfg, draft_vocab_size, aux_ids, init_from)
    features = data.features if data.features is not None else _hf_features(target_dir, data, aux_ids)
    t_feat = time.time() - t0 - t_gen
    trainer, eval_items, curve = _train(target_dir, draft, features, data, cfg, train_cfg, init_from, log_path)
    completion_tokens = sum(len(s) - n for s, n in zip(data.sequences, data.prompt_lengths))
    summary = {
        "rollouts": len(data.sequences), "tokens": sum(len(s) for s in data.sequences),
        "completion_tokens": completion_tokens,
        "train_prompts": len(data.train_prompts), "eval_prompts": len(data.eval_prompts),
        # So benchmarks can hold out every prompt the draft was trained on.
        "train_prompt_texts": [data.prompts[i] for i in sorted(data.train_prompts)],
        "eval_rollouts": len(eval_items),
        "steps": cfg.steps, "draft_vocab_size": draft.shape.draft_vocab_size,
        "started_from": started_from,
        "features": "hf" if data.capture_counts is None else "capture", "capture": data.capture_counts,
        "rollouts_dtype": cfg.dtype,
        "train_config": {k: v for k, v in vars(train_cfg).items()},
        "eval_before": curve[0]["eval"], "eval_after": curve[-1]["eval"],
        "curve": [{k: v for k, v in point.items() if k != "eval"} for point in curve],
        "seconds": {"generate": round(t_gen, 1), "features": round(t_feat, 1),
                    "train": round(time.time() - t0 - t_gen - t_feat, 1)},
    }
    trainer.save(draft_dir, extra={"warm_start": summary})
    # The rollouts themselves (token ids), so budgets and objectives can be compared on the same data.
    (draft_dir / ROLLOUTS).write_text(json.dumps({
        "prompts": data.prompts, "sequences": data.sequences, "prompt_lengths": data.prompt_lengths,
        "prompt_index": data.prompt_index, "eval_prompts": sorted(data.eval_prompts)}))
    return summary


def _saved_rollouts(rollouts_path: Path | str) -> _Rollouts:
    saved = json.loads(Path(rollouts_path).read_text())
    eval_prompts = set(saved["eval_prompts"])
    return _Rollouts(saved["prompts"], saved["sequences"], saved["prompt_lengths"], saved["prompt_index"],
                     set(saved["prompt_index"]) - eval_prompts, eval_prompts)


def _new_rollouts(target_dir: Path, prompts: list[str] | None, cfg: OfflineConfig,
                  aux_ids: tuple[int, ...]) -> _Rollouts:
    """The target's rollouts on ``prompts``; with ``features="capture"`` their features from vLLM itself."""
    from vllm_specrl.trainer.captured import captured_rollouts, describe_capture

    prompts = prompts or default_prompts(cfg.num_prompts, cfg.seed, cfg.task)
    features, capture_counts = None, None
    if cfg.features == "capture":
        captured = captured_rollouts(
            target_dir, prompt_texts(target_dir, prompts, cfg.chat), cfg.samples_per_prompt,
            cfg.max_tokens, cfg.temperature, cfg.seed, cfg.dtype, aux_ids, engine_args=cfg.engine_args)
        sequences, prompt_lengths, prompt_index, features, capture_counts = captured[:5]
        print(f"[warm start] {describe_capture(capture_counts)}", flush=True)
        if not captured.everything[0]:
            raise ValueError("the engine generated no rollouts: no prompts were given (check --prompts)")
        if len(sequences) < MIN_CAPTURED_FRACTION * capture_counts["rollouts"]:
            # Too few captured whole to train on the same data as asked: the rollouts themselves
            # are all there, so their features come from an HF forward instead (the --features hf path).
            print(f"[warm start] fewer than {MIN_CAPTURED_FRACTION:.0%} of the rollouts were captured whole: "
                  f"computing the features of all {len(captured.everything[0])} rollouts with an HF "
                  "forward of the target instead (--features hf does this from the start)", flush=True)
            sequences, prompt_lengths, prompt_index = captured.everything
            features, capture_counts["fallback"] = None, "hf"
    else:
        sequences, prompt_lengths, prompt_index = generate_rollouts(target_dir, prompts, cfg)
    train_prompts, eval_prompts = split_by_prompt(prompt_index, cfg.eval_fraction, cfg.seed)
    return _Rollouts(prompts, sequences, prompt_lengths, prompt_index, train_prompts, eval_prompts,
                     features, capture_counts)


def _starting_draft(target_dir: Path, data: _Rollouts, cfg: OfflineConfig, draft_vocab_size: int | None,
                    aux_ids: tuple[int, ...], init_from: Path | str | None) -> tuple[Any, str]:
    """The draft training starts from, and what it started from (for the summary)."""
    if init_from:
        return load_draft(init_from, target_dir), f"draft {init_from}"
    # The draft vocabulary: the most frequent tokens the target *generates* on the training prompts.
    counts = Counter(t for s, n, i in zip(data.sequences, data.prompt_lengths, data.prompt_index)
                     if i in data.train_prompts for t in s[n:])
    token_counts = torch.zeros(json.loads((target_dir / "config.json").read_text())["vocab_size"])
    for tok_id, c in counts.items():
        token_counts[tok_id] = c
    draft = init_draft(target_dir, None, draft_vocab_size, aux_layer_ids=aux_ids, token_counts=token_counts,
                       seed=cfg.seed)
    if cfg.target_layer is None:
        return draft, "random weights"
    try:
        start_from_target_layer(draft, target_dir, cfg.target_layer)
        return draft, f"target layer {cfg.target_layer}"
    except TargetLayerMissing as exc:
        # A head start, not a requirement: a checkpoint laid out otherwise trains from random weights.
        print(f"[warm start] {exc}: the draft's decoder layer starts from random weights", flush=True)
        return draft, "random weights"


def _hf_features(target_dir: Path, data: _Rollouts, aux_ids: tuple[int, ...]) -> list[dict]:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    target.eval()
    return sequence_features(target, data.sequences, aux_ids, prompt_lengths=data.prompt_lengths)


def _train(target_dir: Path, draft: Any, features: list[dict], data: _Rollouts, cfg: OfflineConfig,
           train_cfg: TrainConfig, init_from: Path | str | None,
           log_path: Path | str | None) -> tuple[DraftTrainer, list[dict], list[dict]]:
    """Train on the training prompts' rollouts; returns the trainer, the held-out items and the learning
    curve (each point with its full evaluation under ``eval``)."""
    rng = random.Random(cfg.seed)
    train_items = [f for f, i in zip(features, data.prompt_index) if i in data.train_prompts]
    if not train_items:
        raise ValueError(f"no rollout to train on ({len(data.sequences)} rollouts over "
                         f"{len(set(data.prompt_index))} prompts, {len(data.eval_prompts)} of them held out): "
                         "give more prompts (--num-prompts or --prompts)")
    eval_items = [f for f, i in zip(features, data.prompt_index) if i in data.eval_prompts] or train_items[:1]
    converted = cfg.parallel_drafting and not draft.parallel
    if converted:
        draft.make_parallel(default_mask_token_id(read_config(target_dir)))
    if init_from and (Path(init_from) / TRAINER_STATE).exists() and not converted:
        # Continue a warm start: its weights, optimizer state and step count.
        trainer = DraftTrainer.from_checkpoint(init_from, target_dir, train_cfg)
    else:
        trainer = DraftTrainer(draft, target_lm_head(target_dir), train_cfg)

    def point(step: int, seen: int) -> dict:
        evaluation = trainer.evaluate_many(eval_items)
        return {"step": step, "completion_tokens": seen, **_curve_point(evaluation), "eval": evaluation}

    curve, seen_tokens = [point(0, 0)], 0
    log = open(log_path, "w") if log_path else None  # noqa: SIM115
    batches = training_batches(train_items, cfg.batch_size, rng, cfg.group_by_length)
    for step in tqdm(range(1, cfg.steps + 1), desc="warm start", mininterval=5):
        picked = next(batches)
        seen_tokens += sum(len(f["token_ids"]) - int(f["first_draft"]) - 1 for f in picked)
        metrics = trainer.step(collate(picked))
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            curve.append(point(step, seen_tokens))
        if log:
            log.write(json.dumps(metrics) + "\n")
    if log:
        log.close()
    curve.append(point(cfg.steps, seen_tokens))
    return trainer, eval_items, curve


def training_batches(items: list[dict[str, torch.Tensor]], batch_size: int, rng: random.Random,
                     group_by_length: bool = False) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Endless training batches: ``length_grouped_batches`` with ``group_by_length``, else
    ``batch_size`` items drawn at random for each."""
    if group_by_length:
        yield from length_grouped_batches(items, batch_size, rng)
    while True:
        yield rng.sample(items, min(batch_size, len(items)))


def length_grouped_batches(items: list[dict[str, torch.Tensor]], batch_size: int, rng: random.Random,
                           megabatch: int = 16) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Endless batches of similar lengths and equal token budgets: each epoch shuffles the items,
    sorts every run of ``megabatch * batch_size`` of them by length (the megabatch scheme of
    transformers' ``LengthGroupedSampler``), cuts it into batches of at most ``batch_size`` times
    the mean length in padded tokens, and shuffles their order.

    A batch is padded to its longest member, and RL answers run from a few tokens to the cap:
    random batches of the demo's task were largely padding, which the draft's first layer and
    attention still compute; grouped, almost none. The token budget (more short sequences per batch,
    fewer long ones) keeps every token's weight in the step's mean loss what it is in a random
    batch: with a fixed count, batches of long answers diluted their tokens and the draft ended
    lower in held-out acceptance (benchmarks/JOURNAL.md, "A better demo draft").
    """
    if not items:
        raise ValueError("no training sequences")
    lengths = {id(f): len(f["token_ids"]) for f in items}
    budget = min(batch_size, len(items)) * sum(lengths.values()) / len(items)
    while True:
        order = list(items)
        rng.shuffle(order)
        batches: list[list[dict[str, torch.Tensor]]] = []
        for start in range(0, len(order), batch_size * megabatch):
            pool = sorted(order[start:start + batch_size * megabatch], key=lambda f: lengths[id(f)], reverse=True)
            batch: list[dict[str, torch.Tensor]] = []
            for f in pool:  # longest first: a batch's padded size is its first member's length x its count
                if batch and (len(batch) + 1) * lengths[id(batch[0])] > budget:
                    batches.append(batch)
                    batch = []
                batch.append(f)
            batches.append(batch)
        rng.shuffle(batches)
        yield from batches


def _curve_point(metrics: dict) -> dict:
    keys = [k for k in metrics if k.startswith("served_") or k in ("loss", "expected_acceptance_length")]
    return {k: metrics[k] for k in keys}
