# Two commands set up a fresh machine:
#   make run   - create .venv, install, run the main job (embedded Prefect + MLflow on SQLite)
#   make test  - create .venv, install (with the CPU torch wheel for the reference tier), run every test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export JAX_PLATFORMS ?= cpu
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1

.PHONY: run test test-fast bench install clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,ref]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m flows.cli finetune data/sample/new.jsonl --preset small --base auto

test: $(STAMP)
	$(PY) -m pytest -q --timeout=900

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) -m bench.run

clean:
	rm -rf .state .cache runs
