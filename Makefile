# Two entry points: `make demo` and `make test`. Each creates or reuses .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pipetrace-installed
DEMO_DIR ?= runs/demo

.PHONY: demo test venv clean

venv: $(STAMP)

# torch is installed first and pinned: pip then keeps it, instead of resolving a CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[torch,tui,perfetto,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pipetrace schedule show 1f1b --ranks 4 --microbatches 8
	$(VENV)/bin/pipetrace schedule verify 1f1b --ranks 4 --microbatches 8 --semantics rendezvous
	$(VENV)/bin/pipetrace schedule simulate 1f1b --ranks 4 --microbatches 8

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
