# kvroute: the two set-up commands are `make demo` and `make test`; both build .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint validate bench load fmt clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,dev,load,plots,scale]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m loadtest.demo

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check kvcore router policies sim loadtest tests
	$(VENV)/bin/ruff format --check kvcore router policies sim loadtest tests
	$(VENV)/bin/mypy

# compose.yaml, the Prometheus config and alert rules, and the Grafana dashboard's queries
# (needs docker-compose and promtool: Debian packages docker-compose and prometheus; .ci/run installs them).
validate: $(STAMP)
	docker-compose -f compose.yaml config -q
	promtool check config deploy/prometheus/prometheus.yml
	$(PY) -m pytest -q -p no:cacheprovider tests/test_deploy.py

fmt: $(STAMP)
	$(VENV)/bin/ruff format kvcore router policies sim loadtest tests
	$(VENV)/bin/ruff check --fix kvcore router policies sim loadtest tests

# Locust multi-turn load on a simulated fleet + router, e.g. make load LOAD_ARGS="--policy round_robin --time 2m"
LOAD_ARGS ?= --users 16 --time 60s --out runs/load
load: $(STAMP)
	$(PY) -m loadtest.load $(LOAD_ARGS)

bench: $(STAMP)
	$(PY) -m loadtest.bench all

clean:
	rm -rf $(VENV) build *.egg-info
