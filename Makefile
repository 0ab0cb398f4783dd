# Quick start:  make demo   (set up .venv and compare every loss-scaling method on the embedded digits data)
#               make test   (set up .venv with the test extras and run the whole suite)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned first: an unpinned torch would pull the newest CUDA build (gigabytes); see DESIGN.md section 5.
TORCH  := torch==2.13.0

.PHONY: demo test install install-chainer install-test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e .
	touch $@

# Chainer 7.8.1 only builds with setuptools<81; the constraint reaches pip's isolated build environment.
$(VENV)/.installed-chainer: $(VENV)/.installed
	printf 'setuptools<81\nnumpy<2\n' > $(VENV)/chainer-constraints.txt
	PIP_CONSTRAINT=$(CURDIR)/$(VENV)/chainer-constraints.txt $(BIN)/pip install --quiet -e '.[chainer]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-chainer
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed-chainer

install-chainer: $(VENV)/.installed-chainer

install-test: $(VENV)/.installed-test

demo: install
	$(BIN)/adaloss compare fp32 none fixed dynamic adaptive --config configs/digits.yaml --set training.epochs=10

test: install-test
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python -m benchmarks --backend all

clean:
	rm -rf $(VENV) runs .pytest_cache
