# Two entry points for a fresh clone: `make demo` (a real training run) and `make test`.
# Each creates .venv on its own when missing; nothing else needs to be installed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench venv clean

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
	$(BIN)/ruff check hvd_spark tests examples
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=25

bench: $(STAMP)
	$(BIN)/python -m hvd_spark.bench allreduce

clean:
	rm -rf $(VENV) build *.egg-info
