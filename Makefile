# pisft: make setup | run | test | bench   (run, test and bench call setup; setup is idempotent)
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV := .venv
PY := $(VENV)/bin/python
LOCK := workflow/envs/cpu-cuda.lock.txt
STAMP := $(VENV)/.pisft-setup
CORES ?= all
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export PYTHONUNBUFFERED := 1

.PHONY: setup run test test-fast bench dvc-yaml lock clean help
.DEFAULT_GOAL := help

help:
	@echo "make run    - install what is missing, run the whole pipeline on the embedded default"
	@echo "make test   - install what is missing, run the whole test suite"
	@echo "make bench  - benchmarks into results/bench/bench.json"
	@echo "make setup  - only create/refresh .venv (idempotent)"

# The stamp holds the hash of the lock file and pyproject.toml: unchanged inputs, no work.
setup:
	@want="$$(cat $(LOCK) pyproject.toml | sha256sum | cut -d' ' -f1)"; \
	if [ -f $(STAMP) ] && [ "$$(cat $(STAMP))" = "$$want" ] && [ -x $(PY) ]; then \
	  echo "setup: $(VENV) is up to date"; exit 0; fi; \
	py="$$(scripts/find-python312.sh)"; \
	if [ ! -x $(PY) ] || ! $(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then \
	  echo "setup: creating $(VENV) with $$py"; rm -rf $(VENV); "$$py" -m venv $(VENV); fi; \
	$(PY) -m pip install --quiet --upgrade pip; \
	echo "setup: installing pinned dependencies from $(LOCK) (first time: several GB, a few minutes)"; \
	$(PY) -m pip install --quiet -r $(LOCK); \
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .; \
	echo "$$want" > $(STAMP); echo "setup: done"

run: setup
	snakemake --cores $(CORES)
	@echo
	@$(PY) -m pisft summary || true
	@echo "Report: $(CURDIR)/results/eval/report.md"

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not integration"

bench: setup
	$(PY) -m pisft bench --config config/config.yaml
	@echo "Benchmarks: $(CURDIR)/results/bench/bench.json"

dvc-yaml: setup
	$(PY) -m pisft dvc-yaml

lock: setup
	{ sed -n '1,/^# Regenerate/p' $(LOCK); $(PY) -m pip freeze --exclude-editable | grep -vi '^pisft'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)

clean:
	rm -rf results .snakemake
