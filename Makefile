# The two commands of the README:  `make quickstart`  and  `make test`.
VENV ?= .venv

.PHONY: setup setup-test quickstart lint docs docs-check test test-fast clean

setup:
	VENV=$(VENV) scripts/setup_env.sh

setup-test:
	VENV=$(VENV) EXTRAS=test scripts/setup_env.sh
	scripts/setup_system.sh
	$(VENV)/bin/python scripts/build_deepspeed_ops.py

quickstart: setup
	$(VENV)/bin/pretrainer train examples/quickstart.yaml

# Code checks: ruff's rules and the import-layer contract (both configured in pyproject.toml).
lint: setup-test
	$(VENV)/bin/ruff check src tests bench examples scripts
	$(VENV)/bin/lint-imports

# The manual: a broken link or anchor fails the build.
docs: setup-test
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The manual's shell blocks marked `<!-- docs-check: run -->`, run as written, in page order (long: they train).
docs-check: setup-test
	$(VENV)/bin/python scripts/docs_check.py

# Two pytest workers (pytest-xdist): one's launches fill the cores the other's leave idle (tests/conftest.py says
# which tests share a worker). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: lint docs
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --durations=15 tests

# The in-process tier only (no torchrun, CLI or launcher processes: tests/conftest.py marks those `processes`),
# for a quick check while changing code; `make test` is the whole suite.
test-fast: setup-test
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) -m "not processes" tests

clean:
	rm -rf runs build .pytest_cache
