# tandem: `make test` runs the suite, `make bench-engine` the engine benchmark.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install test bench-engine peers-vllm clean

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -r requirements.txt
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

# vLLM's CPU build, in its own virtualenv outside tandem's dependencies (a peer for benchmarks).
peers-vllm:
	bash bench/peers/install_vllm.sh

bench-engine: install
	$(PY) bench/engine.py

clean:
	rm -rf $(VENV) .pytest_cache
