# Two commands on a fresh machine: `make export` and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= python3
# The browser test drives Debian's chromium through Playwright; no browser is ever downloaded.
CHROMIUM ?= /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup lock test-setup postgres runner-missing runner-deps runner runner-build export test test-fast bench bench-quick bench-tuning bench-1b bench-widths docs clean

setup: $(VENV)/.installed

test-setup: setup $(CHROMIUM) postgres runner-deps

# uv installs the same set as pip in a third of the time (44 s against 130 s from a fresh clone here);
# it reads no pip configuration, so it is handed pip's find-links (where this machine keeps torch's CPU
# wheel). It compiles the bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set (this machine) no
# process writes any, and every import of torch would compile its sources (the suite: 37 -> 46 min).
# Should uv fail, pip installs the same constraints.
FIND_LINKS = $$($(BIN)/pip config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p" | tr ' ' '\n' \
	| sort -u | sed 's/^/--find-links /')

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt uv
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python $(FIND_LINKS) -c constraints.txt -e '.[test]' \
		|| $(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $@

# constraints.txt from a fresh venv of pyproject.toml's newest allowed versions (run the suite after).
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv && .lock-venv/bin/pip install -q uv -e '.[test]'
	{ sed -n '1,2p' constraints.txt; .lock-venv/bin/pip freeze --exclude-editable | grep -v '^#' | sed 's/+[a-z0-9.]*$$//'; } \
		> constraints.new && mv constraints.new constraints.txt && rm -rf .lock-venv

# Debian's chromium package, when missing (never `playwright install`). Without apt-get
# or root the browser test skips, saying why.
$(CHROMIUM):
	@if command -v apt-get >/dev/null 2>&1; then \
		$(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium \
		|| echo "warning: could not install chromium; the browser test will skip"; \
	else echo "warning: no apt-get to install chromium; the browser test will skip"; fi

# PostgreSQL for the Prefect server of tests/ops/ (its own cluster, started by the tests): Debian's
# postgresql package when initdb is neither on PATH nor where Debian puts it. Without apt-get or root
# those tests skip, saying why.
postgres:
	@if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
		if command -v apt-get >/dev/null 2>&1; then \
			$(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y postgresql \
			|| echo "warning: could not install postgresql; the tests/ops/ tests will skip"; \
		else echo "warning: no apt-get to install postgresql; the tests/ops/ tests will skip"; fi; \
	fi

# The C++ runner (runner/), built against the wheel's libtorch into runner/build/. Debian packages it
# needs are installed when missing (runner-deps); without apt-get or root it is skipped with a warning
# (its test skips). `make test` installs the packages only: tests/runner/ builds the runner with the same
# cmake steps, inside the run, where its one compile shares the cores with the suite instead of holding
# one while the other idles (a build before the tests took 45-60 s of the run's wall time).
# The one list of what the runner's build needs: each Debian package with the header that shows it is there.
# tests/cpp_runner_harness.py asks `make -s runner-missing` rather than keeping a list of its own.
RUNNER_NEEDS := nlohmann-json3-dev:/usr/include/nlohmann/json.hpp libgloo-dev:/usr/include/gloo/context.h \
	libssl-dev:/usr/include/openssl/evp.h
RUNNER_DEBS := cmake g++ $(foreach need,$(RUNNER_NEEDS),$(firstword $(subst :, ,$(need))))

# What the runner's build lacks here, one name a line (a tool, or a Debian package whose header is absent).
RUNNER_MISSING = for tool in cmake c++; do command -v $$tool >/dev/null 2>&1 || echo $$tool; done; \
	for need in $(RUNNER_NEEDS); do [ -e "$${need\#*:}" ] || echo "$${need%%:*}"; done

runner-missing:
	@$(RUNNER_MISSING)

runner-deps:
	@if [ -n "$$($(RUNNER_MISSING))" ]; then \
		if command -v apt-get >/dev/null 2>&1; then \
			$(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y $(RUNNER_DEBS) \
			|| echo "warning: could not install $(RUNNER_DEBS); the C++ runner is not built and its test will skip"; \
		else echo "warning: no apt-get to install $(RUNNER_DEBS); the C++ runner is not built and its test will skip"; fi; \
	fi

runner: setup runner-deps
	@if [ -z "$$($(RUNNER_MISSING))" ]; then $(MAKE) -s runner-build; fi

# The build itself, against the venv's libtorch; tests/runner/ builds the runner with this target too.
runner-build:
	cmake -S runner -B runner/build -DCMAKE_BUILD_TYPE=Release \
		-DCMAKE_PREFIX_PATH="$$($(BIN)/python -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
	cmake --build runner/build -j2

export: setup
	$(BIN)/kiln export --model tiny --tp 2 --report report.json

# Three workers on 2 cores (many tests wait on servers, leases and retries), each test group on one of
# them, the longest groups first (tests/xdist_groups.py; docs/testing.md says what was measured).
XDIST := -n 3

test: test-setup
	$(BIN)/pytest -q -rs --durations=25 $(XDIST)

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

bench-widths: setup
	$(BIN)/python bench/real_width.py

clean:
	rm -rf .kiln report.json runner/build

# docs/recipe.md is generated from the recipe's declarations (kiln/core/plan/recipe.py); a test fails when it is stale.
docs: setup
	$(BIN)/python -m cli.recipe_doc
