# Quick start:  make demo   (set up .venv and compare every loss-scaling method on the embedded digits data)
#               make test   (set up .venv with the test extras and run the whole suite)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned first: an unpinned torch would pull the newest CUDA build (gigabytes); see DESIGN.md section 5.
TORCH  := torch==2.13.0

.PHONY: demo test install install-test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: install
	$(BIN)/adaloss compare fp32 none fixed dynamic adaptive --config configs/digits.yaml --set training.epochs=10

test: install-test
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
