# Quickstart: `make demo` runs the main job on defaults, `make test` runs the suite.
# `make demo-full`: the same demo with the full demo draft (a longer build, more acceptance).
# `make demo DEMO_ARGS="--runs spec,history,plain --dataset-size 8"`: EAGLE-3 and the history proposer.
# `make demo PROPOSER=mtp`: the policy's own MTP layer (builds the real-mimo fixture first, once);
# its two runs go one after another (interleaved, both at once, they outgrow 24 GiB).
# Both set up what they need (venv, fixtures) themselves.
# `make doctor`: every engine patch and what it does on this machine's vLLM; `make selftest`: the
# product's promises (lossless greedy and T=1, weight updates, capture, status) checked on it.
VENV ?= .venv
PY := $(VENV)/bin/python
FIXTURES ?= $(CURDIR)/.fixtures
export VLLM_SPECRL_FIXTURES := $(FIXTURES)

# EAGLE-3 drafts for SmolLM2, built once and cached like the fixtures: `make draft` is the full
# one, warm-started on the demo's task family (arithmetic; bench_rollout / bench_calibration).
# `make demo` uses a quick draft warm-started on the demo's own task (explain: its 81 prompts, a few
# answers each, a few hundred steps in batches of similar length), so that a first run waits minutes
# for it; `make demo-full` builds and uses the full demo draft (32 answers a prompt, 1800 steps), which
# accepts more. The trade-off between the two is in benchmarks/README ("A first run a newcomer waits
# for"). A draft is rebuilt when its arguments change. Drafts train under bf16 autocast where the CPU
# multiplies bf16 natively (`--mixed-precision auto`: AVX512-BF16 or AMX). The demo drafts' rollouts are
# generated at the dtype the demo serves (`--dtype auto`: bf16 on such a CPU), so they train on the hidden
# states the demo's engine hands its drafter; `make draft`'s stay float32, as the benchmarks serve it.
DRAFT ?= $(FIXTURES)/real/drafts/warm-arithmetic
DRAFT_ARGS ?= --task arithmetic --num-prompts 128 --samples 8 --max-tokens 96 --steps 1200 --batch-size 8 --lr 2e-3 \
	--lr-schedule cosine --warmup-steps 25 --draft-vocab-size 4096 --dtype float32 --eval-every 200 --mixed-precision auto
DEMO_DRAFT_COMMON := --task explain --num-prompts 81 --max-tokens 256 --batch-size 8 --lr 2e-3 --lr-schedule cosine \
	--warmup-steps 25 --draft-vocab-size 4096 --dtype auto --mixed-precision auto --group-by-length
DEMO_DRAFT ?= $(FIXTURES)/real/drafts/demo-explain-quick
DEMO_DRAFT_ARGS ?= $(DEMO_DRAFT_COMMON) --samples 4 --steps 600 --eval-every 150 --weight-decay 0.5 --tv-weight 4
DEMO_DRAFT_FULL ?= $(FIXTURES)/real/drafts/demo-explain
DEMO_DRAFT_FULL_ARGS ?= $(DEMO_DRAFT_COMMON) --samples 32 --steps 1800 --eval-every 300
# Bumped when the draft recipe changes under the same arguments (2: warm-start rollouts seeded per
# prompt; 3: from seed 2^30 up, apart from the RL loop's own seeds; 4: the draft's decoder layer starts
# from the target's last layer), so a cached draft built the old way is rebuilt.
DRAFT_RECIPE := 4
TRAIN_DRAFT = VLLM_PLUGINS=specrl VLLM_CPU_KVCACHE_SPACE=2 $(VENV)/bin/vllm-specrl train-draft --offline \
	--target $(FIXTURES)/real/target
# $(call build_draft,DIR,ARGS): (re)build the draft at DIR unless its stamp says it was built with ARGS
# under this DRAFT_RECIPE.
build_draft = if [ ! -f $(1)/trainer_meta.json ] || [ "$$(cat $(1)/make_args 2>/dev/null)" != "$(strip $(2)) recipe=$(DRAFT_RECIPE)" ]; then \
	echo "[draft] building $(1) (missing, or built with other arguments or recipe)"; \
	rm -rf $(1) && $(TRAIN_DRAFT) --draft $(1) $(2) && echo "$(strip $(2)) recipe=$(DRAFT_RECIPE)" > $(1)/make_args; fi

.PHONY: setup fixtures draft demo demo-plan demo-full demo-rollouts rl-run test lint test-all test-slow bench doctor selftest check-vllm \
	clean-fixtures

setup:
	@bash scripts/setup_venv.sh

fixtures: setup
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES)

draft: setup
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES) --only real
	@$(call build_draft,$(DRAFT),$(DRAFT_ARGS))

# Before anything starts: what `make demo` will do here and about how long each phase took on the
# nearest CPU kind measured (scripts/demo_plan.py; standard library only, so before the venv exists).
demo-plan:
	@python3 scripts/demo_plan.py --venv $(VENV) --fixtures $(FIXTURES) --draft $(DEMO_DRAFT) \
		--draft-stamp "$(strip $(DEMO_DRAFT_ARGS)) recipe=$(DRAFT_RECIPE)" || true

demo: demo-plan setup
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES) --only real
ifeq ($(PROPOSER),mtp)
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES) --only real-mimo
	@$(PY) scripts/rl_demo.py --fixtures $(FIXTURES) --proposer mtp --no-interleave-runs $(DEMO_ARGS)
else
	@$(call build_draft,$(DEMO_DRAFT),$(DEMO_DRAFT_ARGS))
	@$(PY) scripts/rl_demo.py --fixtures $(FIXTURES) --draft $(DEMO_DRAFT) $(if $(PROPOSER),--proposer $(PROPOSER)) $(DEMO_ARGS)
endif

demo-full: setup
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES) --only real
	@$(call build_draft,$(DEMO_DRAFT_FULL),$(DEMO_DRAFT_FULL_ARGS))
	@$(PY) scripts/rl_demo.py --fixtures $(FIXTURES) --draft $(DEMO_DRAFT_FULL) $(DEMO_ARGS)

# `make rl-run`: does the draft go stale, and what does online training buy? A GRPO run in which the policy
# learns (scripts/rl_run.py), a second task from step 18, the demo's draft served frozen and trained online, k fixed;
# more arms and seeds
# by RL_ARGS (e.g. RL_ARGS="--arms plain,frozen,online --seeds 0,1,2"); `--target/--draft/--task` for your own.
RL_ARGS ?=
rl-run: setup
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES) --only real
	@$(call build_draft,$(DEMO_DRAFT),$(DEMO_DRAFT_ARGS))
	@$(PY) scripts/rl_run.py --fixtures $(FIXTURES) --draft $(DEMO_DRAFT) $(RL_ARGS)

demo-rollouts: setup
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES) --only real
	@$(PY) scripts/demo_rollouts.py --fixtures $(FIXTURES)

# `make test`: every capability end to end, within CI's budget (tests marked `slow` left out).
# `make test-all`: everything, the slower tier included; `make test-slow`: only the slower tier.
test: fixtures lint
	@$(PY) -m pytest tests -v -m "not slow" --durations=30

# The linter's rules and line length are in pyproject.toml ([tool.ruff]).
lint: setup
	@$(VENV)/bin/ruff check vllm_specrl scripts tests examples

test-all: fixtures
	@$(PY) -m pytest tests -v --durations=30

test-slow: fixtures
	@$(PY) -m pytest tests -v -m slow --durations=30

doctor: setup
	@$(VENV)/bin/vllm-specrl doctor

# `make check-vllm VERSION=0.34.0`: a vLLM release that cannot run here, checked before users install it:
# its source touch point by touch point, then an import-only environment (its Python, no compiled kernels)
# in which the plugin registers the package's methods and vLLM resolves them (scripts/check_vllm_import.sh).
VERSION ?= 0.34.0
check-vllm: fixtures
	@bash scripts/check_vllm_import.sh $(VERSION)

selftest: fixtures
	@$(VENV)/bin/vllm-specrl selftest --model $(FIXTURES)/tiny/target

bench: fixtures
	@$(PY) scripts/bench/bench_rollout.py --fixtures $(FIXTURES)

clean-fixtures:
	rm -rf $(FIXTURES)
