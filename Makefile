# Everything runs from .venv, created on first use from pyproject.toml.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PORT ?= 8000

.PHONY: install demo serve test lint format clean bench soak

$(STAMP): pyproject.toml packaging/django-jobs-ledger/pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e './packaging/django-jobs-ledger[webhook,metrics]' -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## make demo: SQLite in var/, migrate, seed, then worker + dispatcher + web server.
demo: $(STAMP)
	PORT=$(PORT) bash scripts/demo.sh

## make serve: production web process: DEBUG=0, migrate, collectstatic, gunicorn + whitenoise.
## Needs SECRET_KEY, ALLOWED_HOSTS, DATABASE_URL; workers and dispatcher run apart
## (docs/production.md).
serve: $(STAMP)
	PORT=$(PORT) bash scripts/serve.sh

## make test: the whole suite; DATABASE_URL=postgres://... selects PostgreSQL.
test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

## make bench: benchmarks against PostgreSQL (DATABASE_URL); prints figures, asserts nothing.
bench: $(STAMP)
	$(PY) -m bench $(BENCH_ARGS)

## make soak: K report jobs, three qclusters killed at random, provider faults, deadlocks;
## then every invariant is checked (PostgreSQL from DATABASE_URL).
K ?= 300
soak: $(STAMP)
	$(PY) -m tests.chaos.soak --jobs $(K) $(SOAK_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache *.egg-info
