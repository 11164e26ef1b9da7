# The two commands a fresh machine needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck pytest install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## Serve on the embedded default (SQLite under .sparring/, in-memory state) at http://127.0.0.1:8000
run: $(STAMP)
	$(BIN)/sparring serve --migrate

## ruff, mypy and the whole pytest suite (needs the local Postgres and Redis)
test: $(STAMP) lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check app tools sparring examples tests bench migrations
	$(BIN)/ruff format --check app tools sparring examples tests bench migrations

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest

clean:
	rm -rf $(VENV) .venv-openenv .pytest_cache .mypy_cache .ruff_cache
