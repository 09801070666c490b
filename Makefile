# Entry points for a fresh clone: `make demo` (a real training run), `make test` (unit,
# contract and one end-to-end smoke per feature; about 10 minutes on 2 cores, needs only
# Python 3.11 and Java 17), `make test-all` (everything: what CI runs; the multihost tests
# need root, iproute2 and sshd) and `make docs`. Each creates .venv on its own when missing.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# Spark on loopback; Open MPI refuses to start as root (containers, CI) unless told.
export SPARK_LOCAL_IP ?= 127.0.0.1
export OMPI_ALLOW_RUN_AS_ROOT ?= 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM ?= 1

PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider --durations=25

.PHONY: demo test test-all docs lint bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[all]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

lint: $(STAMP)
	$(BIN)/ruff check hvd_spark netns_cluster tests examples
	$(BIN)/lint-imports

# The tiers are markers set in tests/conftest.py (see pyproject's pytest markers).
test: lint
	$(PYTEST) -m "not slow and not multihost and not gpu"

test-all: lint
	$(PYTEST)

docs: $(STAMP)
	$(BIN)/mkdocs build --strict -q

bench: $(STAMP)
	$(BIN)/python -m hvd_spark.bench allreduce

clean:
	rm -rf $(VENV) build *.egg-info
