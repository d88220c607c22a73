# Everything runs from .venv, created on first use from pyproject.toml.
# `make demo` installs the runtime dependencies only; `make test`/`make lint` add the dev
# toolchain (pytest, Playwright, ruff, ...). uv installs them when it is on PATH (or
# UV=path/to/uv), pip otherwise.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUNTIME_STAMP := $(VENV)/.runtime-stamp
STAMP := $(VENV)/.installed-stamp
PORT ?= 8000
PROVIDER_PORT ?= 8025
UV ?= $(shell command -v uv 2>/dev/null)
# setuptools' "Editable installation" warning box looks like an error and is not one.
INSTALL_ENV := PYTHONWARNINGS='ignore:Editable installation:UserWarning'
PIP_INSTALL = $(INSTALL_ENV) $(if $(UV),$(UV) pip install --quiet --python $(PY),$(PY) -m pip install --quiet)
# Parallel test processes (pytest-xdist); each gets its own test database
# (test_<name>_gw0, ...). Most e2e tests wait on real processes, so more workers than
# cores pay; docs/testing.md has the measurements.
TEST_WORKERS ?= 4
# The drills start several worker processes each: fewer at once on a small machine.
DRILL_WORKERS ?= 3
# The SQLite leg: the engine's tests and the drill on SQLite; PostgreSQL-only
# tests are deselected (CI turns their skip into a failure).
SQLITE_TESTS ?= tests/jobs tests/permits/test_drill.py tests/docs/shop_example tests/docs/typed_example

.PHONY: install install-runtime demo serve test test-main test-sqlite drills lint format clean bench soak schedule-drill failover-drill fairness-drill sequence-drill horizon docs package

$(VENV)/bin/python:
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	$(if $(UV),$(UV) venv --quiet --seed --python $(PYTHON) $(VENV),$(PYTHON) -m venv $(VENV))

$(RUNTIME_STAMP): pyproject.toml packaging/django-jobs-ledger/pyproject.toml | $(VENV)/bin/python
	$(PIP_INSTALL) -e './packaging/django-jobs-ledger[webhook,metrics]' -e .
	touch $(RUNTIME_STAMP)

$(STAMP): $(RUNTIME_STAMP)
	$(PIP_INSTALL) -e './packaging/django-jobs-ledger[webhook,metrics]' -e '.[dev]'
	touch $(STAMP)

install-runtime: $(RUNTIME_STAMP)
install: $(STAMP)

## make demo: SQLite in var/, migrate, seed, then worker + dispatcher + web server.
## PORT (8000) and PROVIDER_PORT (8025, the stand-in notice provider) choose the ports.
# A first demo without uv on PATH fetches uv into var/uv (one small wheel from PyPI) and
# installs with it: the demo's install is then about three times faster. If that fails,
# pip installs as before. (Only the demo: the test toolchain keeps pip and its constraints.)
demo: UV := $(or $(UV),$(shell PYTHON=$(PYTHON) sh scripts/fetch-uv.sh))
demo: $(RUNTIME_STAMP)
	PORT=$(PORT) PROVIDER_PORT=$(PROVIDER_PORT) bash scripts/demo.sh

## make serve: production web process: DEBUG=0, migrate, collectstatic, gunicorn + whitenoise.
## Needs SECRET_KEY, ALLOWED_HOSTS, DATABASE_URL; workers and dispatcher run apart
## (docs/production.md).
serve: $(RUNTIME_STAMP)
	PORT=$(PORT) bash scripts/serve.sh

## make test: the suite in parallel on DATABASE_URL (postgres://... selects PostgreSQL),
## then the SQLite leg; the long drills are left to `make drills`. TEST_WORKERS=1 runs one
## process; PYTEST_ARGS reach both legs.
# Both legs run even when the first fails; the target fails if either did.
test: $(STAMP)
	@status=0; $(MAKE) --no-print-directory test-main || status=1; \
	$(MAKE) --no-print-directory test-sqlite || status=1; exit $$status

test-main: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist load --maxschedchunk 1 -m "not drill" $(PYTEST_ARGS)

test-sqlite: $(STAMP)
	@echo "SQLite leg: $(SQLITE_TESTS) on SQLite (DATABASE_URL unset), PostgreSQL-only tests deselected"
	env -u DATABASE_URL $(PY) -m pytest -n $(TEST_WORKERS) --dist load --maxschedchunk 1 -m "not postgres and not drill" $(PYTEST_ARGS) $(SQLITE_TESTS)

## make drills: the long fault drills, measurements and packaging runs (marked `drill`:
## the S3 outage, the soak and scale-out, the burst, the wheels in fresh projects, the
## docs build, ...) on DATABASE_URL. CI runs them after `make test`.
drills: $(STAMP)
	$(PY) -m pytest -n $(DRILL_WORKERS) --dist load --maxschedchunk 1 -m drill $(PYTEST_ARGS)

## make bench: benchmarks against PostgreSQL (DATABASE_URL); prints figures, asserts nothing.
bench: $(STAMP)
	$(PY) -m bench $(BENCH_ARGS)

## make soak: K report jobs, three qclusters killed at random, provider faults, deadlocks;
## then every invariant is checked (PostgreSQL from DATABASE_URL).
K ?= 300
soak: $(STAMP)
	$(PY) -m tests.chaos.soak --jobs $(K) $(SOAK_ARGS)

## make schedule-drill: 3 dispatchers, two periodic kinds every minute for 5 minutes, then
## the database away across 2 ticks (PostgreSQL from DATABASE_URL; about 8 minutes).
schedule-drill: $(STAMP)
	$(PY) -m tests.chaos.schedule_drill $(SCHEDULE_DRILL_ARGS)

## make sequence-drill: 3 worker hosts on one PostgreSQL; 50 keys x 6 items under SIGKILLs,
## a SIGSTOP past the lease and 20 s of provider 500s; the order and the effects checked.
sequence-drill: $(STAMP)
	$(PY) -m tests.chaos.sequence_drill $(SEQUENCE_DRILL_ARGS)

## make horizon MINUTES=60: a steady stream for MINUTES with the archive on; bytes, dead tuples, p99 a minute.
MINUTES ?= 60
horizon: $(STAMP)
	$(PY) -m tests.chaos.horizon --minutes $(MINUTES) $(HORIZON_ARGS)

## make fairness-drill: 3 worker hosts on one PostgreSQL; a flood's bound K, 3:1 shares, alone.
fairness-drill: $(STAMP)
	$(PY) -m tests.chaos.fairness_drill --compare $(FAIRNESS_ARGS)

## make scaleout: 3 worker hosts, one PostgreSQL, an S3 server on loopback; one host killed.
scaleout: $(STAMP)
	$(PY) -m tests.chaos.scaleout $(SCALEOUT_ARGS)

## make failover-drill: a PostgreSQL primary and streaming standby of its own (initdb,
## pg_basebackup, promote; PG_BIN, default /usr/lib/postgresql/15/bin), three worker hosts,
## the stand-in provider and S3 on moto; a synchronous and an asynchronous failover (issue 47).
failover-drill: $(STAMP)
	$(PY) -m tests.chaos.failover $(FAILOVER_ARGS)

## make docs: the documentation site from docs/ into var/docs/ (Sphinx + MyST), strict:
## a warning, a broken link or a broken reference fails it. Open var/docs/index.html.
DOCS_OUT ?= var/docs
SPHINXOPTS ?= -W --keep-going -n -q
docs: $(STAMP)
	$(PY) -m sphinx -b html -E $(SPHINXOPTS) docs $(DOCS_OUT)
	@echo "docs: $(DOCS_OUT)/index.html"

## make package: the app's sdist and wheel in var/dist/, checked by twine.
package: $(STAMP)
	rm -rf var/dist
	$(PY) -m build --outdir var/dist packaging/django-jobs-ledger
	$(PY) -m twine check --strict var/dist/*

## make lint: ruff, then mypy (strict, django-stubs) over the docs' examples as an adopter's
## project would type-check them ([tool.mypy] in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache *.egg-info

## make release: the app's sdist and wheel of jobs.__version__ in var/dist/, twine-checked;
## prints the tag and upload commands (docs/app/releasing.md). Uploads nothing.
.PHONY: release
release: package
	@version=$$($(PY) -c 'import jobs; print(jobs.__version__)'); \
	ls var/dist/django_jobs_ledger-$$version.tar.gz var/dist/django_jobs_ledger-$$version-py3-none-any.whl >/dev/null || exit 1; \
	echo "release: django-jobs-ledger $$version built and checked in var/dist/ (nothing uploaded)"; \
	echo "  tag:    git tag -a v$$version -m \"django-jobs-ledger $$version\" && git push origin v$$version"; \
	echo "  upload: $(PY) -m twine upload var/dist/django_jobs_ledger-$$version.tar.gz var/dist/django_jobs_ledger-$$version-py3-none-any.whl"
