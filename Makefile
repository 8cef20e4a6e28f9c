# Quick start: `make run` (serve the bundled pair and generate) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HTTP_PORT ?= 8000

.PHONY: run test lint clean gpu-wheels

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

# The wheels tools/gpu_check.sh installs on a GPU machine without a registry (its image's Python
# 3.12 has torch and the rest), at the versions pyproject.toml pins.
GPU_WHEELS := pyzmq orjson setproctitle starlette uvicorn uvloop httptools llguidance
gpu-wheels: $(STAMP)
	$(BIN)/pip download -q --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
	    --python-version 3.12 --implementation cp --no-deps -d .gpu-wheels \
	    $$($(BIN)/python -c 'import tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; \
	        print(*(d for d in deps if d.split("==")[0] in "$(GPU_WHEELS)".split()))')

clean:
	rm -rf $(VENV) .pytest_cache
