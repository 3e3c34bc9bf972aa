# Quickstart: `make demo` runs the main job on defaults, `make test` runs the suite.
# Both set up what they need (venv, fixtures) themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
FIXTURES ?= $(CURDIR)/.fixtures
export VLLM_SPECRL_FIXTURES := $(FIXTURES)

# The demo's warm-started EAGLE-3 draft for SmolLM2 (built once, cached like the fixtures).
DRAFT ?= $(FIXTURES)/real/drafts/warm-arithmetic
DRAFT_ARGS ?= --num-prompts 96 --samples 8 --max-tokens 96 --steps 600 --batch-size 8 --lr 2e-3 \
	--draft-vocab-size 8192 --dtype bfloat16 --eval-every 150

.PHONY: setup fixtures draft demo demo-rollouts test bench clean-fixtures

setup:
	@bash scripts/setup_venv.sh

fixtures: setup
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES)

draft: setup
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES) --only real
	@test -f $(DRAFT)/trainer_meta.json || VLLM_PLUGINS=specrl VLLM_CPU_KVCACHE_SPACE=1 \
		$(VENV)/bin/vllm-specrl train-draft --offline --task arithmetic \
		--target $(FIXTURES)/real/target --draft $(DRAFT) $(DRAFT_ARGS)

demo: draft
	@$(PY) scripts/rl_demo.py --fixtures $(FIXTURES) --draft $(DRAFT)

demo-rollouts: setup
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES) --only real
	@$(PY) scripts/demo_rollouts.py --fixtures $(FIXTURES)

test: fixtures
	@$(PY) -m pytest tests -v

bench: fixtures
	@$(PY) scripts/bench_rollout.py --fixtures $(FIXTURES)

clean-fixtures:
	rm -rf $(FIXTURES)
