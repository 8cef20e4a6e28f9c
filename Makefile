# Quick start: `make run` (serve the bundled pair and generate) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HTTP_PORT ?= 8000

.PHONY: run test lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,convert,ucx,plots]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/nebula-flow run --http-port $(HTTP_PORT)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=25  # (the slowest tests, to keep CI short)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
