# Two commands: `make run` and `make test`. Both create .venv if it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned and installed first, so nothing that depends on it pulls another build.
TORCH := torch==2.13.0

$(BIN)/activate:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)

$(VENV)/.installed: $(BIN)/activate pyproject.toml
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

.PHONY: run test test-slow bench
run: $(VENV)/.installed
	$(BIN)/trustbatch train

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

test-slow: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m slow

bench: $(VENV)/.installed
	$(BIN)/python bench/objectives.py
