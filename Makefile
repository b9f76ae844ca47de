# Two commands do all the set-up: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench clean

# Reinstall whenever the pins or the declared dependencies change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet -c constraints.txt -e '.[notebook,test,dev]'
	touch $(STAMP)

# torchrun starts 2 workers; one thread each, as 2 workers share 2 cores here.
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --standalone --nproc-per-node 2 -m nbaccel.lessons.demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest

# The peers' columns need the bench extra (HF Accelerate, Lightning), pinned like the rest.
bench: $(STAMP)
	$(PIP) install --quiet -c constraints.txt -e '.[bench]'
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/launch.py
	$(BIN)/python benchmarks/live.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
