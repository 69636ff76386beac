# Two entry points (see README): `make demo` and `make test`. Both create .venv/ first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup model demo test test-all bench clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch is pinned to the CPU build (2.13.0); an unpinned torch would pull CUDA wheels.
	$(BIN)/python -m pip install --quiet -e ".[hf,test]"
	touch $(STAMP)

setup: $(STAMP)

# The real default model, dequantized once into ~/.cache/llama-parity (not the repo).
model: setup
	$(BIN)/llama-parity fetch-smollm2

demo: setup
	$(BIN)/llama-parity demo

# Default suite: tiny random checkpoints plus the SmolLM2 checks (well under 15 min on 2 cores).
test: model
	$(BIN)/python -m pytest -ra

# Everything, including tests marked slow.
test-all: model
	$(BIN)/python -m pytest -ra -m "slow or not slow"

bench: model
	$(BIN)/python bench/bench_models.py

clean-venv:
	rm -rf $(VENV)
