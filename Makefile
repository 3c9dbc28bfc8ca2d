# rankwatch — `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help

.PHONY: help
help: ## List the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | \
	  awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-10s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $(STAMP)

.PHONY: venv
venv: $(STAMP) ## Create the Python environment (.venv) with rankwatch and its dev tools

.PHONY: build
build: $(STAMP) ## Build everything: the environment and the native libraries
	@if [ -f native/Makefile ]; then $(MAKE) -C native; fi

.PHONY: jars
jars: $(STAMP) ## Fetch the Kafka broker's jars from Maven Central (cached outside the repo)
	$(BIN)/rankwatch fetch-jars

.PHONY: lint
lint: $(STAMP) ## ruff and mypy
	$(BIN)/ruff check .
	$(BIN)/mypy ingest streams diagnosis rankwatch tests bench

# Real services some tests run (Alertmanager, Prometheus, headless Chromium), from Debian's
# packages: installed when missing (apt-get as root, else sudo), nothing done when present.
TEST_DEBS := prometheus-alertmanager prometheus chromium chromium-driver

.PHONY: test-deps
test-deps: ## Install the Debian packages the tests run for real, when missing
	@missing=""; for p in $(TEST_DEBS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ]; then echo "test-deps: all present ($(TEST_DEBS))"; exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null; then sudo="sudo"; \
	else echo "test-deps: missing$$missing; install them as root (apt-get install$$missing)" >&2; exit 1; fi; \
	echo "test-deps: installing$$missing"; \
	$$sudo apt-get update -q && \
	DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q --no-install-recommends $$missing

.PHONY: test
test: build jars test-deps lint ## Set everything up and run every test (unit, integration, e2e)
	$(BIN)/python -m pytest -q -ra tests

# tests/unit never starts a service (tests/conftest.py refuses it); tests marked `slow` there
# simulate whole jobs or import real torch, and run in `make test`.
.PHONY: test-unit
test-unit: build ## Run the unit tests: no broker, no ClickHouse server, no training (< 1 min)
	$(BIN)/python -m pytest -q -ra -m "not slow" tests/unit

.PHONY: demo
demo: build jars ## Start the local stack, run a job with a fault, print the diagnosis, stop
	$(BIN)/python -m rankwatch.demo

.PHONY: up down status
up: build jars ## Start the local stack (Kafka broker + worker) in ~/.local/share/rankwatch
	$(BIN)/rankwatch up
down: $(STAMP) ## Stop the local stack
	$(BIN)/rankwatch down
status: $(STAMP) ## Show the local stack's health
	$(BIN)/rankwatch status

.PHONY: bench
bench: build jars ## Run the benchmarks (prints figures)
	$(BIN)/rankwatch bench ingest

.PHONY: clean
clean: ## Remove the environment and build outputs (not the jar cache or ~/.local/share/rankwatch)
	rm -rf $(VENV) build native/build .mypy_cache .ruff_cache .pytest_cache
