# Two commands on a fresh machine: `make export` and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= python3
# The browser test drives Debian's chromium through Playwright; no browser is ever downloaded.
CHROMIUM ?= /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup test-setup export test test-fast bench bench-quick bench-tuning bench-1b clean

setup: $(VENV)/.installed

test-setup: setup $(CHROMIUM)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# Debian's chromium package, when missing (never `playwright install`). Without apt-get
# or root the browser test skips, saying why.
$(CHROMIUM):
	@if command -v apt-get >/dev/null 2>&1; then \
		$(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium \
		|| echo "warning: could not install chromium; the browser test will skip"; \
	else echo "warning: no apt-get to install chromium; the browser test will skip"; fi

export: setup
	$(BIN)/kiln export --model tiny --tp 2 --report report.json

test: test-setup
	$(BIN)/pytest -q -rs

test-fast: setup
	$(BIN)/pytest -q -rs -m "not slow"

bench: setup
	$(BIN)/kiln bench

bench-quick: setup
	$(BIN)/kiln bench --quick

bench-tuning: setup
	$(BIN)/python bench/tuning.py

# Memory at a real size: a Llama-3.2-1B-shaped checkpoint (~2.5 GB) exported at tp 2 and verified (~12 GiB).
bench-1b: setup
	$(BIN)/python bench/scale_1b.py

clean:
	rm -rf .kiln report.json
