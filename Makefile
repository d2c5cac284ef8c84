# Two commands set up a fresh machine:
#   make run   - create .venv, install, run the main job (embedded Prefect + MLflow on SQLite)
#   make test  - create .venv, install (with the CPU torch wheel for the reference tier), run every test
# and the documentation site: make docs (serve on 127.0.0.1:8000), make docs-build (--strict, as CI)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The tests pin the CPU (CI has no accelerator, and their tolerances are float32's); make run and
# make bench use whatever JAX finds (a TPU or GPU with the [tpu] or [gpu] extra installed).
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1

.PHONY: run test test-fast bench serve install clean docs docs-build

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,ref,cluster]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m needle_flows.cli finetune data/sample/new.jsonl --preset small --base auto

# Two pytest workers (TEST_WORKERS), each taking whole files (--dist loadfile), so a module's
# servers and stack start once: most of the suite waits on subprocesses and servers, and one
# process used about one of the two cores. Files in tests/conftest.py's order (end-to-end first),
# not xdist's default of the files with the most tests first.
TEST_WORKERS ?= 2
test: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest -q --timeout=900 --durations=30 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-fast: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) -m bench.run

# The champion of the local store over HTTP: MLflow /invocations and OpenAI /v1/chat/completions.
serve: $(STAMP)
	MLFLOW_TRACKING_URI=$${MLFLOW_TRACKING_URI:-sqlite:///$(CURDIR)/.state/mlflow.db} \
	  $(PY) -m needle_flows.cli serve models:/needle@champion --host 127.0.0.1 --port $${PORT:-5123}

# The documentation site (mkdocs.yml): the docs extra on top of the install; the reference pages
# are generated from the code at every build (docs/gen_ref.py), into .cache/site.
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP) pyproject.toml constraints.txt
	$(PY) -m pip install -q -c constraints.txt -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --dev-addr 127.0.0.1:$${PORT:-8000}

docs-build: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf .state .cache runs
