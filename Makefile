# Two set-up commands on a fresh machine:  `make up` (the main job)  and  `make test` (the test suite); `make check`
# is the quick unit lane to run while editing. Each creates or refreshes the virtualenv in $(VENV). torch is
# installed first, pinned, so that pip takes the CPU wheel instead of pulling a CUDA build as a dependency of another
# package.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvgate-installed
# pytest-xdist workers of `make test` and `make check`: each test file (and the whole e2e tier) runs whole on one
# worker (tests/conftest.py). `make test TEST_WORKERS=0` runs the suite in this process, one test at a time.
# Timing-based tests must hold with the other worker busy.
TEST_WORKERS ?= 2
# `make check` leaves out the tests with these markers (pyproject.toml): `processes` (the test starts a server,
# Envoy, an engine, the CLI or any other subprocess) and `slow` (in-process but long), and the e2e tier. It is held
# to under 3 minutes on 2 cores; --unit-lane (tests/conftest.py) makes a test that starts a process fail, naming
# the marker it lacks. `make test` runs every test, whatever its markers.
CHECK_MARKERS := not processes and not slow

.PHONY: venv up test check bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

up: venv
	$(BIN)/kvgate up --replicas 2 --model demo --port 8080

test: venv
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile tests

check: venv
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --unit-lane -m "$(CHECK_MARKERS)" --ignore=tests/e2e tests

bench: venv
	$(BIN)/kvgate bench engine

clean:
	rm -rf $(VENV) build *.egg-info
