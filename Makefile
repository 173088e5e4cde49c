# Two entry points: `make run` (the pipeline) and `make test` (lint + tests).
# Both create .venv and install the project on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU machines: the CPU build of torch (a local wheel where the machine has one).
# GPU machines: `make TORCH_SPEC=torch install` takes the default CUDA build.
TORCH_SPEC ?= torch==2.13.0
CORES ?= all

.PHONY: install run test lint clean bench-regress bench-rebaseline

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

run: install
	$(BIN)/snakemake --cores $(CORES) --printshellcmds

lint: install
	$(BIN)/ruff check .

# pytest exits 5 when it collects nothing: not a failure for a selection like -m "not gpu".
test: lint
	TRITON_INTERPRET=1 $(BIN)/pytest -q -m "not gpu" $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

# Regression benchmarks (docs/bench.md): measure, compare with results/baselines/regress.json, fail with a
# table. Re-baseline on purpose: make bench-rebaseline REASON="why" [GROUPS="pipeline greedy"].
bench-regress: install
	$(BIN)/python -m rimuru.bench.regress check

bench-rebaseline: install
	@test -n "$(REASON)" || { echo 'usage: make bench-rebaseline REASON="why the baselines change" [GROUPS="pipeline ..."]' >&2; exit 2; }
	$(BIN)/python -m rimuru.bench.regress $(foreach g,$(GROUPS),--group $(g)) rebaseline --reason "$(REASON)"

clean:
	rm -rf $(VENV) .snakemake
