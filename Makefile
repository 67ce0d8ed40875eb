# Two commands on a fresh machine: `make bench` (the main job) and `make test`.
# The local PyTorch is pinned here; pyproject.toml declares a range for users.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

.PHONY: bench test test-fast design lint

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIN)
	$(BIN)/python -m pip install -q -e '.[bench,train,dev]' $(TORCH_PIN)
	touch $@

bench: $(VENV)/.installed
	$(BIN)/cerar bench

design: $(VENV)/.installed
	$(BIN)/cerar design

lint: $(VENV)/.installed
	$(BIN)/ruff check src tests benchmarks examples

# Every layer: unit (single process), multirank (Gloo ranks), integration (commands, netns), in
# two passes. First every test that starts no ranks, on two workers as in test-fast: they are
# independent and each uses one core. Then every test that starts ranks, in one process: those
# use both cores themselves, and several wait on timeouts that a second test's load would stretch.
test: $(VENV)/.installed
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/python -m pytest -q -n 2 -m "not multirank"
	$(BIN)/python -m pytest -q -m multirank

# The single-process layer only, no ranks started and no command run end to end: the maths, the
# simulators, the import contract; its tests are independent, so two workers share them.
test-fast: $(VENV)/.installed
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/python -m pytest -q -n 2 tests/unit -m "not multirank and not slow"

