# The two commands of the README:  `make quickstart`  and  `make test`.
VENV ?= .venv

.PHONY: setup setup-test quickstart test clean

setup:
	VENV=$(VENV) scripts/setup_env.sh

setup-test:
	VENV=$(VENV) EXTRAS=test scripts/setup_env.sh
	scripts/setup_system.sh
	$(VENV)/bin/python scripts/build_deepspeed_ops.py

quickstart: setup
	$(VENV)/bin/pretrainer train examples/quickstart.yaml

test: setup-test
	$(VENV)/bin/python -m pytest -q tests

clean:
	rm -rf runs .pytest_cache
