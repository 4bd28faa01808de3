# The two set-up commands of the README: `make demo` and `make test`.
# Each installs what it needs (a virtualenv in .venv, the browser client in web/node_modules).

VENV ?= .venv
PYTHON ?= python3
BIN = $(VENV)/bin

.PHONY: demo test check install browser clean

demo: install
	$(BIN)/hangar demo

test: install browser check
	$(BIN)/pytest

check: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

install: $(VENV)/.installed web/node_modules/.package-lock.json

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

web/node_modules/.package-lock.json: web/package-lock.json
	cd web && npm ci --no-audit --no-fund --loglevel=error

# Browser tests drive Debian's Chromium; install it where we can (root with apt-get).
browser:
	@if [ -x /usr/bin/chromium ]; then exit 0; fi; \
	if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
		|| echo "WARNING: could not install chromium; browser tests will skip (and fail in CI)"; \
	else \
		echo "WARNING: /usr/bin/chromium missing and cannot be installed here; browser tests will skip"; \
	fi

clean:
	rm -rf $(VENV) web/node_modules test-artifacts
