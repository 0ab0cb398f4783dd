# Quick start:  make demo   (set up .venv with adaloss and torch only, compare every loss-scaling method on the
#                            embedded digits data: about 2 minutes on 2 CPU cores)
#               make test   (set up .venv with Chainer and the test extras and run the whole suite)
#               make check-wheel (build the wheel, install it into a fresh venv, run the README's promises)
#               make docs   (regenerate docs/configuration.md's key reference from the config schema)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned first: an unpinned torch would pull the newest CUDA build (gigabytes); see docs/architecture.md 7.
TORCH  := torch==2.13.0

.PHONY: demo test check-wheel docs install install-chainer install-test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e .
	touch $@

# Chainer 7.8.1 is an sdist whose build needs setuptools<81 (pkg_resources). pip's isolated build environment
# would take the newest setuptools (and pip >= 26.2 no longer passes PIP_CONSTRAINT into it), so build without
# isolation against the setuptools<81 installed first; Chainer needs it at run time too. The same two commands
# work outside a checkout with 'adaloss[chainer]' (docs/library.md, "Chainer").
$(VENV)/.installed-chainer: $(VENV)/.installed
	$(BIN)/pip install --quiet 'setuptools>=77,<81'
	$(BIN)/pip install --quiet --no-build-isolation -e '.[chainer]'
	touch $@

# The test extra holds Lightning, accelerate and transformers, which depend on torch: the constraints file keeps
# the pinned torch (and pip from fetching a CUDA build) whatever they ask for.
$(VENV)/.installed-test: $(VENV)/.installed-chainer
	echo '$(TORCH)' > $(VENV)/constraints.txt
	$(BIN)/pip install --quiet --constraint $(VENV)/constraints.txt -e '.[test]'
	touch $@

# adaloss and torch: what the library, the CLI and the demo use. Chainer is an extra (install-chainer, test).
install: $(VENV)/.installed

install-chainer: $(VENV)/.installed-chainer

install-test: $(VENV)/.installed-test

demo: install
	$(BIN)/adaloss compare fp32 none fixed dynamic adaptive --config digits --set training.epochs=10

# Two worker processes, each file on one of them (its module fixtures built once): most tests wait on processes
# they start (CLI runs, torchrun, compiles), so two workers take about two thirds of one's time even on 2 cores.
test: install-test
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# A few minutes: the wheel as a user installs it, checked from the repository root and from another folder.
check-wheel:
	PYTHON=$(PYTHON) bash .ci/check_wheel.sh

# Both backends' benchmarks: the Chainer one needs Chainer.
bench: install-chainer
	$(BIN)/python -m benchmarks --backend all

# The config-key reference in docs/configuration.md is generated; tests/cli/test_docs.py fails while it is stale.
docs: install
	$(BIN)/python -m adaloss_cli.config.docs --update docs/configuration.md

clean:
	rm -rf $(VENV) runs .pytest_cache
