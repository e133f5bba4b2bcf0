# The two commands a new user needs: `make demo` and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test venv venv-test bench schema clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@ $(VENV)/.installed

venv: $(VENV)/.installed

venv-test: $(VENV)/.installed-test

demo: venv
	$(BIN)/rollmarket demo

test: venv-test
	$(BIN)/python -m pytest

bench: venv
	$(BIN)/python benchmarks/exchange_throughput.py

schema: venv
	$(BIN)/rollmarket schema --out schema/

clean:
	rm -rf $(VENV) .pytest_cache
