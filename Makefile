# Two commands do all the set-up: `make demo` and `make test`. Both create .venv on first use.
# `make check` is the contributor's fast loop (about a minute): lint, the architecture's rules
# and every test that starts no process; `make test` runs everything.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
STAMP  := $(VENV)/.installed
# Nothing here puts $(BIN) on PATH: the lessons and tests run as a kernel registered from the
# venv does, and call commands through the interpreter (`!{sys.executable} -m nbaccel ...`).

.PHONY: demo lessons lab check test lint rules bench clean chromium slurm gpu-check

# Reinstall whenever the pins or the declared dependencies change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet -c constraints.txt -e '.[notebook,test,dev,deepspeed,browser,trackers,slurm,transformers,stateful]'
	$(BIN)/python -m nbaccel build-ops
	touch $(STAMP)

# The flagship lesson, headless in a real kernel on 2 CPU workers; prints where the results are.
demo: $(STAMP)
	$(BIN)/python -m lessonbuild.runner demo --out results/demo

# Re-execute every lesson in place (their committed outputs come from this).
lessons: $(STAMP)
	$(BIN)/python -m lessonbuild.runner lessons

lab: $(STAMP)
	$(BIN)/jupyter lab notebooks/

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The fast tier: the tests that start no process, no kernel and no notebook (tests/conftest.py
# selects them by their markers, and fails one that starts a process: it needs a marker). The
# architecture's rules are among them (tests/package/test_architecture.py); `make rules` prints
# what they measure.
check: lint
	$(BIN)/python -m pytest --fast tests

rules: $(STAMP)
	$(BIN)/python -m tests.package.structure --check

# The browser tests drive Debian's Chromium (never a downloaded browser). As root (CI) make
# installs it and the tests must run; elsewhere they run if it is there and skip if not.
CHROMIUM := /usr/bin/chromium
ROOT    := $(shell test "$$(id -u)" = 0 && echo required)
BROWSER := $(ROOT)

chromium:
	@if [ ! -x $(CHROMIUM) ] && [ "$(BROWSER)" = required ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends chromium > /dev/null; \
	elif [ ! -x $(CHROMIUM) ]; then \
		echo "note: no $(CHROMIUM); the browser tests will skip (sudo apt-get install chromium)"; \
	fi

# The cluster tests (tests/slurm) start a two-node SLURM cluster on this machine from Debian's
# packages, and stop it after. As root (CI) make installs the packages and the tests must run;
# elsewhere they skip and say how to run them.
SLURM_PACKAGES := slurmctld slurmd slurm-client munge

slurm:
	@if [ ! -x /usr/sbin/slurmctld ] && [ "$(ROOT)" = required ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends $(SLURM_PACKAGES) > /dev/null; \
	elif [ ! -x /usr/sbin/slurmctld ]; then \
		echo "note: no SLURM; the cluster tests will skip (sudo make slurm installs it)"; \
	fi

test: lint chromium slurm
	NBACCEL_BROWSER=$(BROWSER) NBACCEL_SLURM=$(ROOT) $(BIN)/python -m pytest

# The GPU tier (tests/gpu) and the GPU benchmarks (benchmarks/gpu.py), from this working tree with
# a given interpreter and no venv: on a GPU machine, `make gpu-check PYTHON=python3` (at most 8
# minutes on one GPU; results in benchmarks/results/gpu-*). Without PYTHON, the venv's when there
# is one. Without CUDA the tier is collected and skipped, and the benchmarks say in one line that
# they measured nothing.
GPU_PYTHON := $(if $(filter command line,$(origin PYTHON)),$(PYTHON),$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)))
gpu-check:
	PYTHON=$(GPU_PYTHON) benchmarks/gpu-check.sh

# The peers' columns need the bench extra (HF Accelerate, Lightning), pinned like the rest.
bench: $(STAMP)
	$(PIP) install --quiet -c constraints.txt -e '.[bench]'
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/launch.py
	$(BIN)/python benchmarks/live.py
	$(BIN)/python benchmarks/breakdown.py
	$(BIN)/python benchmarks/interrupt.py
	$(BIN)/python benchmarks/sharding.py
	$(BIN)/python benchmarks/collectives.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
