# Two set-up commands on a fresh machine:  `make up` (the main job)  and  `make test` (the test suite).
# Both create or refresh the virtualenv in $(VENV). torch is installed first, pinned, so that pip takes
# the CPU wheel instead of pulling a CUDA build as a dependency of another package.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvgate-installed
# pytest-xdist workers of `make test`: each test file (and the whole e2e tier) runs whole on one worker
# (tests/conftest.py); 33-36 min on 2 cores, cold, instead of 45 serially. `make test TEST_WORKERS=0` runs
# the suite in this process, one test at a time. Timing-based tests must hold with the other worker busy.
TEST_WORKERS ?= 2

.PHONY: venv up test bench clean

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

bench: venv
	$(BIN)/kvgate bench engine

clean:
	rm -rf $(VENV) build *.egg-info
