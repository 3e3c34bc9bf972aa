# Quickstart: `make demo` runs the main job on defaults, `make test` runs the suite.
# `make demo DEMO_ARGS="--runs spec,history,plain --dataset-size 8"`: EAGLE-3 and the history proposer.
# `make demo PROPOSER=mtp`: the policy's own MTP layer (builds the real-mimo fixture first, ~15 min once).
# Both set up what they need (venv, fixtures) themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
FIXTURES ?= $(CURDIR)/.fixtures
export VLLM_SPECRL_FIXTURES := $(FIXTURES)

# EAGLE-3 drafts for SmolLM2, built once and cached like the fixtures: `make draft` is the full
# one, warm-started on the demo's task family (arithmetic; bench_rollout / bench_calibration);
# `make demo` uses one warm-started on the demo's own task (explain: all 81 of its prompts x 8
# answers, 900 steps in batches of similar length, about 17 minutes on 2 cores); the demo draft is
# rebuilt when DEMO_DRAFT_ARGS change. Both train under bf16 autocast where the CPU multiplies bf16 natively
# (`--mixed-precision auto`: AVX512-BF16 or AMX; 2x faster per step, the same learning curve).
DRAFT ?= $(FIXTURES)/real/drafts/warm-arithmetic
DRAFT_ARGS ?= --task arithmetic --num-prompts 128 --samples 8 --max-tokens 96 --steps 1200 --batch-size 8 --lr 2e-3 \
	--lr-schedule cosine --warmup-steps 25 --draft-vocab-size 4096 --dtype float32 --eval-every 200 --mixed-precision auto
DEMO_DRAFT ?= $(FIXTURES)/real/drafts/demo-explain
# 16 answers per prompt and 1800 steps: served first-draft acceptance +0.066 over 8 answers and 900 steps
# in make demo's steps (benchmarks/README, "Twice the warm-start data"), for twice the build time.
DEMO_DRAFT_ARGS ?= --task explain --num-prompts 81 --samples 16 --max-tokens 256 --steps 1800 --batch-size 8 --lr 2e-3 \
	--lr-schedule cosine --warmup-steps 25 --draft-vocab-size 4096 --dtype float32 --eval-every 300 --mixed-precision auto --group-by-length
# Bumped when the draft recipe changes under the same arguments (2: warm-start rollouts seeded per
# prompt; 3: from seed 2^30 up, apart from the RL loop's own seeds), so a cached draft built the old way
# is rebuilt.
DRAFT_RECIPE := 3
TRAIN_DRAFT = VLLM_PLUGINS=specrl VLLM_CPU_KVCACHE_SPACE=2 $(VENV)/bin/vllm-specrl train-draft --offline \
	--target $(FIXTURES)/real/target
# $(call build_draft,DIR,ARGS): (re)build the draft at DIR unless its stamp says it was built with ARGS
# under this DRAFT_RECIPE.
build_draft = if [ ! -f $(1)/trainer_meta.json ] || [ "$$(cat $(1)/make_args 2>/dev/null)" != "$(strip $(2)) recipe=$(DRAFT_RECIPE)" ]; then \
	echo "[draft] building $(1) (missing, or built with other arguments or recipe)"; \
	rm -rf $(1) && $(TRAIN_DRAFT) --draft $(1) $(2) && echo "$(strip $(2)) recipe=$(DRAFT_RECIPE)" > $(1)/make_args; fi

.PHONY: setup fixtures draft demo demo-rollouts test test-all test-slow bench clean-fixtures

setup:
	@bash scripts/setup_venv.sh

fixtures: setup
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES)

draft: setup
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES) --only real
	@$(call build_draft,$(DRAFT),$(DRAFT_ARGS))

demo: setup
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES) --only real
ifeq ($(PROPOSER),mtp)
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES) --only real-mimo
	@$(PY) scripts/rl_demo.py --fixtures $(FIXTURES) --proposer mtp $(DEMO_ARGS)
else
	@$(call build_draft,$(DEMO_DRAFT),$(DEMO_DRAFT_ARGS))
	@$(PY) scripts/rl_demo.py --fixtures $(FIXTURES) --draft $(DEMO_DRAFT) $(if $(PROPOSER),--proposer $(PROPOSER)) $(DEMO_ARGS)
endif

demo-rollouts: setup
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES) --only real
	@$(PY) scripts/demo_rollouts.py --fixtures $(FIXTURES)

# `make test`: every capability end to end, within CI's budget (tests marked `slow` left out).
# `make test-all`: everything, the slower tier included; `make test-slow`: only the slower tier.
test: fixtures
	@$(PY) -m pytest tests -v -m "not slow" --durations=30

test-all: fixtures
	@$(PY) -m pytest tests -v --durations=30

test-slow: fixtures
	@$(PY) -m pytest tests -v -m slow --durations=30

bench: fixtures
	@$(PY) scripts/bench_rollout.py --fixtures $(FIXTURES)

clean-fixtures:
	rm -rf $(FIXTURES)
