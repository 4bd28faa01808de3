# The two set-up commands of the README: `make demo` and `make test`.
# Each installs what it needs (a virtualenv in .venv, the page's libraries in web/vendor).

VENV ?= .venv
PYTHON ?= python3
BIN = $(VENV)/bin
TYPECHECK = build/typecheck/hangar

.PHONY: demo test check install browser constraints clean

demo: install
	$(BIN)/hangar demo

test: install browser check
	$(BIN)/pytest

check: install $(TYPECHECK)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

install: $(VENV)/.installed

# The package data includes web/vendor, so it is copied before the install. Every Python
# package installs at the version in constraints.txt, the set the tests last passed with.
$(VENV)/.installed: pyproject.toml constraints.txt web/vendor/.copied
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

# Take the newest releases pyproject.toml admits into constraints.txt (then run `make test`).
constraints: web/vendor/.copied
	rm -rf build/constraints && $(PYTHON) -m venv build/constraints
	build/constraints/bin/python -m pip install --quiet --upgrade pip setuptools
	build/constraints/bin/python -m pip install --quiet -e '.[dev]'
	{ echo "# Written by \`make constraints\`: the versions \`make install\` takes."; \
	  build/constraints/bin/python -m pip freeze --exclude-editable; } > constraints.txt
	rm -rf build/constraints

web/node_modules/.package-lock.json: web/package-lock.json
	cd web && npm ci --no-audit --no-fund --loglevel=error

# The page loads its libraries from web/vendor (shipped in the wheel), copied from npm's tree.
web/vendor/.copied: web/node_modules/.package-lock.json web/vendor.txt
	rm -rf web/vendor && mkdir -p web/vendor
	cd web && while read -r file; do case "$$file" in ''|\#*) ;; *) cp "node_modules/$$file" vendor/;; esac; done < vendor.txt
	touch $@

# mypy follows the installed names (hangar.*) through links to the folders.
$(TYPECHECK):
	mkdir -p $@
	for part in shared server drone; do ln -sfn ../../../$$part $@/$$part; done

# Browser tests drive Debian's Chromium, and shell commands run in Debian's bubblewrap sandbox;
# install what is missing where we can (root with apt-get).
browser:
	@missing=""; \
	[ -x /usr/bin/chromium ] || missing="$$missing chromium"; \
	command -v bwrap >/dev/null || missing="$$missing bubblewrap"; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
		|| echo "WARNING: could not install$$missing; their tests will skip (and fail in CI)"; \
	else \
		echo "WARNING:$$missing missing and cannot be installed here; their tests will skip"; \
	fi

clean:
	rm -rf $(VENV) web/node_modules web/vendor build test-artifacts
