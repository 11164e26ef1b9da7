# The two commands a fresh machine needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# eval-protocol's own client, which the remote rollout tests drive sparring with, in a virtualenv of its
# own: eval-protocol 0.3.33 needs mcp<2 and openai<3 (through litellm), sparring pins mcp 2 and openai 3.
EP_VENV := .venv-eval-protocol
EP_REQUIREMENTS := tests/remote/eval_protocol_client/requirements.txt
EP_STAMP := $(EP_VENV)/.installed
# openenv's own clients, which the OpenEnv front door's tests drive, in a virtualenv of their own too:
# openenv 0.10.0 needs fastmcp 3 and so mcp<2. Pinned in pyproject's `openenv-client` extra.
OE_VENV := .venv-openenv
OE_STAMP := $(OE_VENV)/.pinned
# openreward, the other ORS client, likewise: it pins sse-starlette 2, the server's mcp needs 3.
# Pinned in pyproject's `openreward-client` extra.
OR_VENV := .venv-openreward
OR_STAMP := $(OR_VENV)/.pinned

.PHONY: run test lint typecheck pytest install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(EP_STAMP): $(EP_REQUIREMENTS)
	test -x $(EP_VENV)/bin/python || $(PYTHON) -m venv $(EP_VENV)
	$(EP_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(EP_VENV)/bin/python -m pip install --quiet -r $(EP_REQUIREMENTS)
	touch $(EP_STAMP)

$(OE_STAMP): pyproject.toml $(STAMP)
	$(BIN)/python -c "from tests.episodes.openenv_client import ensure_venv; ensure_venv()"

$(OR_STAMP): pyproject.toml $(STAMP)
	$(BIN)/python -c "from tests.episodes.openreward_client import ensure_venv; ensure_venv()"

install: $(STAMP) $(EP_STAMP) $(OE_STAMP) $(OR_STAMP)

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

pytest: $(STAMP) $(EP_STAMP) $(OE_STAMP) $(OR_STAMP)
	$(BIN)/pytest

clean:
	rm -rf $(VENV) $(EP_VENV) $(OE_VENV) $(OR_VENV) .pytest_cache .mypy_cache .ruff_cache
