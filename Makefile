# `make run`: set up and serve the default model.  `make test`: set up and run the test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup run test test-fast clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

run: setup
	$(VENV)/bin/pagedlm serve

test: setup
	$(PY) -m pytest -q --durations=15

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
