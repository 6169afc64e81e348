# Two entry points: `make demo` and `make test`. Each creates or reuses .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pipetrace-installed
DEMO_DIR ?= runs/demo

.PHONY: demo test venv clean

venv: $(STAMP)

# torch is installed first and pinned: pip then keeps it, instead of resolving a CUDA build.
# The MindSpore backend's extra comes last (~2.8 GB; it holds numpy below 2, see pyproject.toml).
$(STAMP): pyproject.toml setup.py Makefile pipetrace/analyze/_linescan.c pipetrace/recorder/_queue.c pipetrace/recorder/_lines.c pipetrace/recorder/_queue.h
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[torch,tui,perfetto,test]'
	$(PY) -m pip install --quiet -e '.[mindspore]'
	touch $(STAMP)

# Train the demo model on 4 local ranks with 1F1B (recorded, checked against a
# single-process run), then explain the recording.
demo: $(STAMP)
	rm -rf $(DEMO_DIR)
	$(VENV)/bin/pipetrace run --schedule 1f1b --ranks 4 --microbatches 8 --steps 3 --check-parity --out $(DEMO_DIR)
	$(VENV)/bin/pipetrace analyze $(DEMO_DIR)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
