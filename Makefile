# pisft: make setup | run | test | bench   (run, test and bench call setup; setup is idempotent)
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pisft-setup
# DEVICE picks the pinned environment .venv is built from (it does not pick the device a run
# trains on: that is `device:` in the config, e.g. config/profiles/ascend-8card.yaml):
#   cpu, cuda  workflow/envs/cpu-cuda.lock.txt        x86_64; PyPI's torch (a CUDA build, runs on the CPU)
#   npu        workflow/envs/ascend-aarch64.lock.txt  Ascend hosts (aarch64, CANN 9.1.0): CPU torch + torch-npu;
#              setup then ends with the node's preflight, `python -m pisft doctor` (about a minute)
# Without DEVICE, the lock .venv was last built from is kept (cpu when there is none).
LOCK_cpu := workflow/envs/cpu-cuda.lock.txt
LOCK_cuda := $(LOCK_cpu)
LOCK_npu := workflow/envs/ascend-aarch64.lock.txt
# The LIBERO simulator (closed-loop evaluation; docs/libero.md, "The LIBERO simulator"), for every lock:
# hf-libero, robosuite and bddl installed --no-deps from their own pinned file (their declared
# dependencies would replace opencv-python-headless and pull wandb, robomimic...; what they import is
# pinned in the lock), then scripts/libero_sim_setup.py: OpenGL libraries (apt-get, as root), scene
# assets checked against a manifest, LIBERO's config file, robosuite's private macro file.
SIM_NODEPS := workflow/envs/libero-sim.nodeps.txt
# The lock is installed by uv (pinned here, installed into .venv by pip): from its cache a fresh
# .venv takes about 25 s where pip took 3.5 min (docs/development.md). uv reads no pip.conf: an
# index set for pip (PIP_INDEX_URL or pip's global.index-url) is handed to it, UV_INDEX_URL first;
# if uv fails, pip installs the lock as before.
UV := uv==0.13.9
SIM_INPUTS := $(wildcard $(SIM_NODEPS) workflow/envs/libero-assets.txt workflow/envs/libero-assets.sha256 scripts/libero_sim_setup.py)
STAMP_LOCK := $(word 2,$(shell cat $(STAMP) 2>/dev/null))
DEVICE ?= $(if $(filter $(LOCK_npu),$(STAMP_LOCK)),npu,cpu)
LOCK := $(LOCK_$(DEVICE))
ifeq ($(LOCK),)
$(error DEVICE=$(DEVICE) (from the $(origin DEVICE)) is not one of cpu, cuda, npu)
endif
CORES ?= all
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export PYTHONUNBUFFERED := 1

.PHONY: setup run run-pi05-cpu test test-all test-fast bench dvc-yaml lock clean help
.DEFAULT_GOAL := help

help:
	@echo "make run    - install what is missing, run the whole pipeline on the embedded default"
	@echo "make test   - install what is missing, run the test suite CI runs"
	@echo "make test-all - make test plus the tests marked extended (docs/development.md, Tiers)"
	@echo "make bench  - benchmarks into results/bench/bench.json"
	@echo "make run-pi05-cpu - the whole DAG with pi0.5 at its real size on this CPU (about 40 min; switches config/config.yaml)"
	@echo "make setup  - only create/refresh .venv (idempotent)"
	@echo "DEVICE=cpu|cuda|npu picks the pinned environment (npu: Ascend, CANN 9.1.0); now: $(DEVICE) -> $(LOCK)"

# The stamp holds the hash of the lock file, pyproject.toml and the simulator's inputs, then the lock's path: unchanged
# inputs, no work. Another lock rebuilds .venv from scratch (pip never removes packages, so the
# Ascend lock on top of the CUDA one would keep nvidia-* and CUDA torch). A stamp without a path
# predates DEVICE and stands for the CPU/CUDA lock.
setup:
	@want="$$(cat $(LOCK) pyproject.toml $(SIM_INPUTS) | sha256sum | cut -d' ' -f1) $(LOCK)"; \
	have="$$(cat $(STAMP) 2>/dev/null || true)"; \
	case "$$have" in *" "*|"") ;; *) have="$$have $(LOCK_cpu)";; esac; \
	if [ "$$have" = "$$want" ] && [ -x $(PY) ]; then \
	  echo "setup: $(VENV) is up to date"; exit 0; fi; \
	if [ "$(DEVICE)" = npu ]; then \
	  if [ -z "$${ASCEND_HOME_PATH:-}$${ASCEND_TOOLKIT_HOME:-}" ]; then \
	    echo "setup: DEVICE=npu needs CANN 9.1.0 installed and its set_env.sh sourced first (e.g. source /usr/local/Ascend/ascend-toolkit/set_env.sh); torch-npu without CANN breaks 'import torch'" >&2; \
	    exit 1; fi; \
	  [ "$$(uname -m)" = aarch64 ] || echo "setup: note: $(LOCK) is resolved and tested for aarch64; this host is $$(uname -m)"; \
	fi; \
	py="$$(scripts/find-python312.sh)"; \
	if [ -x $(PY) ] && [ -n "$$have" ] && [ "$${have#* }" != "$(LOCK)" ]; then \
	  echo "setup: $(VENV) was built from $${have#* }; recreating it from $(LOCK)"; rm -rf $(VENV); fi; \
	if [ ! -x $(PY) ] || ! $(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then \
	  echo "setup: creating $(VENV) with $$py"; rm -rf $(VENV); "$$py" -m venv $(VENV); fi; \
	$(PY) -m pip install --quiet --upgrade pip; \
	echo "setup: installing pinned dependencies from $(LOCK) (first time: several GB, a few minutes)"; \
	$(PY) -m pip install --quiet $(UV); \
	index="$${UV_INDEX_URL:-$${PIP_INDEX_URL:-$$($(PY) -m pip config get global.index-url 2>/dev/null || true)}}"; \
	if ! $(VENV)/bin/uv pip install --python $(PY) --quiet $${index:+--index-url "$$index"} -r $(LOCK); then \
	  echo "setup: uv could not install $(LOCK) (above); installing it with pip instead"; \
	  $(PY) -m pip install --quiet -r $(LOCK); fi; \
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .; \
	echo "setup: installing the LIBERO simulator from $(SIM_NODEPS) (--no-deps; its dependencies are in $(LOCK))"; \
	$(PY) -m pip install --quiet --no-deps --require-hashes -r $(SIM_NODEPS); \
	$(PY) scripts/libero_sim_setup.py all; \
	echo "setup: compiling the installed packages to bytecode once (every stage and test process then loads it)"; \
	$(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null 2>&1 || \
	  echo "setup: note: some installed files did not compile to bytecode; Python compiles them when they are imported"; \
	if [ "$(DEVICE)" = npu ] && ! $(PY) -c 'import torch, torch_npu; print("setup: torch", torch.__version__, "torch_npu", torch_npu.__version__)'; then \
	  echo "setup: torch_npu does not import (above); check that CANN 9.1.0 is installed and its set_env.sh sourced" >&2; exit 1; fi; \
	echo "$$want" > $(STAMP); echo "setup: done"
	@if [ "$(DEVICE)" = npu ]; then echo "setup: preflight of this node: $(PY) -m pisft doctor"; \
	  $(PY) -m pisft doctor || { echo "setup: .venv is installed, but this node failed the preflight above; fix what it names, then rerun '$(PY) -m pisft doctor'" >&2; exit 1; }; fi

run: setup
	snakemake --cores $(CORES)
	@echo
	@$(PY) -m pisft summary || true
	@echo "Report: $(CURDIR)/results/eval/report.md"
	@if [ -f results/recap/report.md ]; then echo "RECAP loop: $(CURDIR)/results/recap/report.md"; fi

# pi0.5 at its real size (random weights, the VLM frozen) through the whole DAG on the CPU
# (config/profiles/pi05-cpu.yaml; docs/what-has-run-where.md). `git checkout config/config.yaml
# dvc.yaml` goes back to the embedded default.
run-pi05-cpu: setup
	$(PY) -m pisft profile config/profiles/pi05-cpu.yaml
	snakemake --cores $(CORES)
	@$(PY) -m pisft summary || true

# The suite on TEST_WORKERS pytest-xdist workers (0: one process, no xdist). A test file, and the
# tests of one session-wide pipeline run, stay on one worker (tests/worker_groups.py; docs/development.md).
# Three on CI's two cores: a third worker runs while another's test waits (Slurm's time limit, a
# driver's polling); measured against two on one host the same day (docs/development.md, "Tests").
TEST_WORKERS ?= 3
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

# --durations=30: CI's output (.ci/run calls `make test`) lists the 30 slowest set-ups, tests and
# tear-downs, so each round starts from measured test times.
# Two tiers (docs/development.md, "Tiers"): `make test` is CI's suite, every class of behaviour;
# `make test-all` adds the tests marked `extended`, each a second, costlier witness of a behaviour
# that a test of `make test` already holds (the list and its time are in docs/development.md).
test: setup
	$(PYTEST) -m "not extended" --durations=30

test-all: setup
	$(PYTEST) --durations=30

test-fast: setup
	$(PYTEST) -m "not integration and not extended"

bench: setup
	$(PY) -m pisft bench --config config/config.yaml
	@echo "Benchmarks: $(CURDIR)/results/bench/bench.json"

dvc-yaml: setup
	$(PY) -m pisft dvc-yaml

lock: setup
	{ sed -n '1,/^# Regenerate/p' $(LOCK); $(PY) -m pip freeze --exclude-editable | grep -viE '^(pisft|hf[-_]libero|robosuite|bddl|uv)([=@ ]|$$)'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)

clean:
	rm -rf results .snakemake
