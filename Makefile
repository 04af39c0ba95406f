# `make demo` and `make test` work on a fresh Debian 12 machine as root: they install what they need.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
APT_PACKAGES := slurm-wlm munge libslurm-dev lua5.1 build-essential python3-venv python3-dev \
                slurmdbd mariadb-server
PYTEST_ARGS ?=

.PHONY: deps demo test test-gpu test-slurm24 test-cgroup2 spank clean gpu-proof gpu-tests gpu-wheels gpu-site-bundle \
        gpu-site-proof install uninstall rollback
.DEFAULT_GOAL := test

# System packages only when something is missing, so a warm machine does not touch apt. The
# devcluster runs its own MariaDB and slurmdbd on loopback: a policy-rc.d (when the machine has none)
# keeps the packages' own system services from starting during the install.
.deps-apt.stamp: Makefile
	@missing=""; for b in slurmctld slurmd munged lua5.1 gcc slurmdbd mariadbd mariadb-install-db; do \
	  command -v $$b >/dev/null 2>&1 || [ -x /usr/sbin/$$b ] || missing=1; done; \
	  [ -f /usr/include/slurm/spank.h ] || missing=1; \
	  python3 -c 'import venv, ensurepip' 2>/dev/null || missing=1; \
	if [ -n "$$missing" ]; then \
	  rcd=""; if [ ! -e /usr/sbin/policy-rc.d ]; then \
	    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && rcd=1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES); st=$$?; \
	  if [ -n "$$rcd" ]; then rm -f /usr/sbin/policy-rc.d; fi; exit $$st; \
	fi
	@touch $@

# The venv is made from the system's Python: the devcluster's jobs run as an ordinary user, and run this
# venv's interpreter, so it must not live under root's home (a pyenv Python there fails them with
# "Permission denied"). A venv made from another Python is made again.
SYSTEM_PYTHON ?= /usr/bin/python3
ifneq ($(wildcard $(VENV)/pyvenv.cfg),)
ifeq ($(shell grep -cx 'home = $(patsubst %/,%,$(dir $(SYSTEM_PYTHON)))' $(VENV)/pyvenv.cfg),0)
$(info the venv $(VENV) is not made from $(SYSTEM_PYTHON): making it again)
$(shell rm -rf $(VENV))
endif
endif

$(PY): | .deps-apt.stamp
	$(SYSTEM_PYTHON) -m venv $(VENV)

# torch==2.13.0 is the local CPU wheel; any other spec would download the CUDA build.
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,nvml,eval]'
	@touch $@

deps: .deps-apt.stamp $(VENV)/.installed spank

spank: .deps-apt.stamp
	$(MAKE) -s -C spank

# Install into a prefix of its own, as a site installs an add-on (docs/admin.md, "Install"): its own
# virtual environment per release, the antman command, the SPANK plugin, the systemd units, the Lua
# scripts, the agent bundle, the docs. Nothing in /etc is written. AGENT_PYTHONS: further CPython
# versions ("3.10 3.12") whose jobs get the agent without pyzmq of their own.
PREFIX         ?= /opt/slurm-antman
BINDIR         ?= /usr/local/bin
UNIT_DIR       ?= /usr/local/lib/systemd/system
PLUGIN_DIR     ?= $(or $(shell pkg-config --variable=libdir slurm 2>/dev/null | sed -e 's|$$|/slurm|' | grep .),\
                       /usr/lib/$(or $(shell gcc -print-multiarch 2>/dev/null),x86_64-linux-gnu)/slurm-wlm)
INSTALL_PYTHON ?= $(SYSTEM_PYTHON)
AGENT_PYTHONS  ?=
install: .deps-apt.stamp
	PREFIX='$(PREFIX)' BINDIR='$(BINDIR)' UNIT_DIR='$(UNIT_DIR)' PLUGIN_DIR='$(PLUGIN_DIR)' \
	  INSTALL_PYTHON='$(INSTALL_PYTHON)' AGENT_PYTHONS='$(AGENT_PYTHONS)' packaging/install.sh

uninstall:
	PREFIX='$(PREFIX)' packaging/uninstall.sh

rollback:
	PREFIX='$(PREFIX)' packaging/rollback.sh

demo: deps
	$(PY) -m slurm_antman.cli demo $(DEMO_ARGS)

# Fails on any failure, and on "no tests ran" (pytest exit 5). `make test` leaves the tests marked
# slow (minutes of devcluster each: the trace replay, the fault scenarios) to `make test-slow`, so
# that it stays under 15 minutes; .ci/run runs both.
test: deps
	$(PY) -m pytest -ra -m "not slow" $(PYTEST_ARGS)

# The demo's own test (marker demo) runs in the cgroup v2 guest (make test-cgroup2); here its loop runs in
# tests/test_site_proof.py, the same sequence (lab/demo.py, run_loop) under `make gpu-site-proof`.
SLOW_MARKS ?= slow and not demo
test-slow: deps
	$(PY) -m pytest -ra -m "$(SLOW_MARKS)" $(PYTEST_ARGS)

test-gpu: deps
	$(PY) -m pytest -ra -m gpu $(PYTEST_ARGS)

# The cluster tests (and the tests that build or run against the installed Slurm) once more against
# Slurm 24.11, in a Debian trixie chroot built by .ci/slurm24 with mmdebstrap from Debian's mirror and
# cached in /var/cache/slurm-antman (SLURM24_ROOT); the venv is this checkout's, bind-mounted. The
# slow tests stay with `make test-slow` (22.05), and so do those marked slurm_neutral (the sidecar's
# and the agent's own mechanics, whose Slurm calls other cluster tests make on 24.11 too). Not two clusters at once: the chroot shares the
# host's loopback ports with `make test`'s clusters. The second run's sbatch signs with munge: the
# chroot's own munged serves it (the PID namespace ends it with the run). Its pytest cache stays in the
# chroot's /tmp: .ci/run runs it beside the cgroup v2 guest, whose rerun reads the checkout's cache.
SLURM24_PYTEST ?= -m "cluster and not slurm_neutral and (not slow or every_release)"
test-slurm24: $(VENV)/.installed
	.ci/slurm24 build
	.ci/slurm24 run 'rc=0; $(PY) -m pytest -ra -o cache_dir=/tmp/pytest-cache $(SLURM24_PYTEST) $(PYTEST_ARGS) || rc=1; \
	  mkdir -p /run/munge && chown munge: /run/munge && \
	  { munge -n >/dev/null 2>&1 || runuser -u munge -- /usr/sbin/munged; } && \
	  $(PY) -m pytest -ra -o cache_dir=/tmp/pytest-cache tests/test_spank_build.py tests/test_slurm_version.py \
	    tests/test_doctor.py tests/test_job_submit_lua.py tests/test_spank_elastic.py tests/test_job_submit_elastic_lua.py \
	    -m "not cluster" $(PYTEST_ARGS) || rc=1; exit $$rc'

# The cluster tests once more on a node that boots the unified cgroup v2 hierarchy, with the newest
# Slurm: a User-Mode Linux guest of Debian sid (Slurm 26.05, systemd, CgroupPlugin=autodetect ->
# cgroup/v2, device rules as eBPF programs) built by .ci/uml with mmdebstrap and cached in
# /var/cache/slurm-antman (UML_CACHE); the checkout and its venv are bind-mounted in. The guest has its
# own loopback, so it may run beside a host cluster. The demo's AntMan loop (a slow test on the host) runs
# there too. Its munged signs the last run's sbatch calls.
# What runs there: the device grants (each class, arrays, srun steps, requeues, the failure path), the
# submission and refusal paths, the adapter's parsers, doctor, slurmd registering again under running
# jobs, the replay of its own sacct history and the demo. Not the whole cluster suite: the single-CPU guest
# runs it at about a third of the host's speed, past CI's budget (docs/benchmarks.md, "CI"); make install
# and the upgrade (tests/test_admin_guide.py, tests/test_install.py) passed there by hand on 2026-11-29.
CGROUP2_MARKS = cluster and not slurm_neutral and (not slow or demo or every_release)
CGROUP2_PYTEST ?= -m "$(CGROUP2_MARKS)" tests/test_demo.py tests/test_cgroup2_devices.py tests/test_site_cluster.py \
  tests/test_cluster_submission.py tests/test_slurm_adapter.py tests/test_doctor.py tests/test_opp_count_registration.py \
  tests/test_sacct_replay_cluster.py
test-cgroup2: $(VENV)/.installed
	.ci/uml build
	.ci/uml run 'rc=0; $(PY) -m pytest -ra $(CGROUP2_PYTEST) $(PYTEST_ARGS) || rc=1; \
	  mkdir -p /run/munge && chown munge: /run/munge && \
	  { [ -s /etc/munge/munge.key ] || runuser -u munge -- mungekey --create --force; } && \
	  { munge -n >/dev/null 2>&1 || runuser -u munge -- /usr/sbin/munged; } && \
	  $(PY) -m pytest -ra tests/test_spank_build.py tests/test_slurm_version.py tests/test_doctor.py \
	    tests/test_job_submit_lua.py tests/test_spank_elastic.py tests/test_job_submit_elastic_lua.py \
	    tests/test_spank_cgroup_bpf.py -m "not cluster" $(PYTEST_ARGS) || rc=1; exit $$rc'

# --- GPU proof (docs/gpu_proof.md) ------------------------------------------------------
# The GPU node is offline and has torch, nvidia-ml-py and pytest but not pyzmq, PyYAML or pydantic:
# `make gpu-wheels` (anywhere with network) downloads them into .whl/ for Python 3.12 on x86-64, and
# `make gpu-proof` (on the GPU node) installs what is missing from there with `pip install --no-index`
# into .whl/site, then runs the proof into $(GPU_PROOF_DIR). Neither target needs the venv or apt.
GPU_PY        ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_PROOF_DIR ?= gpu-proof
GPU_PROOF_ARGS ?=
WHEEL_PY      ?= $(if $(wildcard $(PY)),$(PY),python3)

gpu-wheels:
	@mkdir -p .whl
	pins="$$($(WHEEL_PY) -m slurm_antman.lab.bench.wheels list)" && \
	$(WHEEL_PY) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl $$pins

gpu-proof:
	$(GPU_PY) -m slurm_antman.lab.bench.wheels install --wheels .whl --target .whl/site
	PYTHONPATH="$(CURDIR)/.whl/site:$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" \
	  $(GPU_PY) -m slurm_antman.cli bench gpu --out $(GPU_PROOF_DIR) $(GPU_PROOF_ARGS)

# The `gpu`-marked tests on the GPU node, one file per pytest run, each test under a timeout, every
# outcome and reason (-rA) in $(GPU_PROOF_DIR)/tests.log as it comes and in a JUnit file per test file:
# a run cut short by the node's command limit keeps what it had (2026-11-26, run 4, lost every
# failure's reason when pytest was killed before its summary). Exits 1 if any file failed.
GPU_TESTS        ?= tests/test_agent_busy.py tests/test_agent_memory.py tests/test_agent_pause.py \
                    tests/test_sidecar_telemetry.py tests/test_driver_caps.py tests/test_bench_models.py \
                    tests/test_bench_gpu.py
GPU_TEST_TIMEOUT ?= 240

gpu-tests:
	$(GPU_PY) -m slurm_antman.lab.bench.wheels install --wheels .whl --target .whl/site
	@mkdir -p $(GPU_PROOF_DIR); rc=0; for f in $(GPU_TESTS); do \
	  PYTHONPATH="$(CURDIR)/.whl/site:$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" \
	    $(GPU_PY) -m pytest -m gpu -rA -p no:cacheprovider --timeout=$(GPU_TEST_TIMEOUT) \
	    --junitxml=$(GPU_PROOF_DIR)/junit-$$(basename $$f .py).xml $$f 2>&1 | tee -a $(GPU_PROOF_DIR)/tests.log; \
	  [ "$${PIPESTATUS[0]}" -eq 0 ] || rc=1; \
	done; exit $$rc

# --- The whole product on the GPU: a one-node Slurm site (docs/gpu_proof.md, "A Slurm site on the GPU") ----
# Here (Debian 12 with make deps done, and the network): `make gpu-site-bundle` puts Debian's Slurm 22.05 and
# munge packages with their libraries' packages and the SPANK plugin built against them into .site/slurm
# (lab/devcluster/carried_slurm.py), and the wheels of `make gpu-wheels` into .whl/ (both git-ignored: the
# device call names them in its carry). There (bare: no Slurm, no munge, no network): `make gpu-site-proof`
# installs what the wheels add, unpacks that Slurm into a prefix beside the cluster and runs the proof into
# $(GPU_SITE_PROOF_DIR): site.json and site.md. Without a GPU (CI) the same target runs the same loop on
# the devcluster's emulated GPU, with the carried Slurm where .site/slurm exists and the installed one else.
SITE_BUNDLE         ?= .site/slurm
GPU_SITE_PROOF_DIR  ?= gpu-site-proof
GPU_SITE_PROOF_ARGS ?=

gpu-site-bundle: gpu-wheels
	$(WHEEL_PY) -m slurm_antman.lab.devcluster.carried_slurm build --out $(SITE_BUNDLE)

gpu-site-proof:
	@if [ -d .whl ]; then $(GPU_PY) -m slurm_antman.lab.bench.wheels install --wheels .whl --target .whl/site; fi
	PYTHONPATH="$(CURDIR)/.whl/site:$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" PYTHONUNBUFFERED=1 \
	  $(GPU_PY) -m slurm_antman.lab.siteproof.proof --out $(GPU_SITE_PROOF_DIR) \
	  $(if $(wildcard $(SITE_BUNDLE)/manifest.json),--bundle $(SITE_BUNDLE)) $(GPU_SITE_PROOF_ARGS)

clean:
	$(MAKE) -s -C spank clean || true
	rm -rf $(VENV) .deps-apt.stamp .pytest_cache
