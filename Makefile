# `make demo` and `make test` work on a fresh Debian 12 machine as root: they install what they need.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
APT_PACKAGES := slurm-wlm munge libslurm-dev lua5.1 build-essential python3-venv python3-dev
PYTEST_ARGS ?=

.PHONY: deps demo test test-gpu spank clean
.DEFAULT_GOAL := test

# System packages only when something is missing, so a warm machine does not touch apt.
.deps-apt.stamp:
	@missing=""; for b in slurmctld slurmd munged lua5.1 gcc; do \
	  command -v $$b >/dev/null 2>&1 || [ -x /usr/sbin/$$b ] || missing=1; done; \
	  [ -f /usr/include/slurm/spank.h ] || missing=1; \
	  python3 -c 'import venv, ensurepip' 2>/dev/null || missing=1; \
	if [ -n "$$missing" ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES); \
	fi
	@touch $@

$(PY): | .deps-apt.stamp
	python3 -m venv $(VENV)

# torch==2.13.0 is the local CPU wheel; any other spec would download the CUDA build.
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,nvml]'
	@touch $@

deps: .deps-apt.stamp $(VENV)/.installed spank

spank: .deps-apt.stamp
	$(MAKE) -s -C spank

demo: deps
	$(PY) -m slurm_antman.cli demo $(DEMO_ARGS)

# Fails on any failure, and on "no tests ran" (pytest exit 5).
test: deps
	$(PY) -m pytest -ra $(PYTEST_ARGS)

test-gpu: deps
	$(PY) -m pytest -ra -m gpu $(PYTEST_ARGS)

clean:
	$(MAKE) -s -C spank clean || true
	rm -rf $(VENV) .deps-apt.stamp .pytest_cache
