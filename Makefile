# Two commands on a fresh machine: `make export` and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= python3

.PHONY: setup export test test-fast bench bench-quick clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

export: setup
	$(BIN)/kiln export --model tiny --tp 2 --report report.json

test: setup
	$(BIN)/pytest -q -rs

test-fast: setup
	$(BIN)/pytest -q -rs -m "not slow"

bench: setup
	$(BIN)/kiln bench

bench-quick: setup
	$(BIN)/kiln bench --quick

clean:
	rm -rf .kiln report.json
