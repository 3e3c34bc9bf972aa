# Quickstart: `make demo` runs the main job on defaults, `make test` runs the suite.
# Both set up what they need (venv, fixtures) themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
FIXTURES ?= $(CURDIR)/.fixtures
export VLLM_SPECRL_FIXTURES := $(FIXTURES)

.PHONY: setup fixtures demo demo-rollouts test bench clean-fixtures

setup:
	@bash scripts/setup_venv.sh

fixtures: setup
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES)

demo: setup
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES) --only real
	@$(PY) scripts/rl_demo.py --fixtures $(FIXTURES)

demo-rollouts: setup
	@$(VENV)/bin/vllm-specrl fixtures --out $(FIXTURES) --only real
	@$(PY) scripts/demo_rollouts.py --fixtures $(FIXTURES)

test: fixtures
	@$(PY) -m pytest tests -v

bench: fixtures
	@$(PY) scripts/bench_rollout.py --fixtures $(FIXTURES)

clean-fixtures:
	rm -rf $(FIXTURES)
