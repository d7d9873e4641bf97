# Two commands for a new machine:  `make serve` (install + start) and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Without an NVIDIA GPU, pin the CPU-capable torch first so pip does not fetch a multi-GB CUDA
# build; with one, the range in pyproject.toml brings the usual CUDA build.
TORCH  ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,torch==2.13.0)
# Where that torch comes from: this project's machines have the CPU build on local disk; from
# PyPI, add TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu" for the CPU build.
TORCH_INDEX ?=
EXTRAS ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,)
ARGS   ?=

.PHONY: install install-dev serve test lint clean prometheus lock

$(VENV)/.base:
	python3 -m venv $(VENV)
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)" $(TORCH_INDEX),)
	touch $@

$(VENV)/.installed: $(VENV)/.base pyproject.toml
	$(PY) -m pip install -q -e ".$(if $(EXTRAS),[$(EXTRAS)],)"
	touch $@

$(VENV)/.installed-dev: $(VENV)/.base pyproject.toml
	$(PY) -m pip install -q -e ".[dev$(if $(EXTRAS),$(comma)$(EXTRAS),)]"
	touch $@ $(VENV)/.installed

comma := ,

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

## serve: install and start the service (CPU: host shared-memory pool, built-in ViT-B/16)
serve: install
	$(PY) -m app $(ARGS)

## test: install the dev tools and run every test (GPU tests skip without CUDA)
test: install-dev prometheus
	$(PY) -m pytest $(ARGS)

## prometheus: promtool and prometheus for tests/test_alerts.py (Debian's package; needs root)
prometheus:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null \
	  || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	       && apt-get update -qq \
	       && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } \
	  || echo "prometheus not installed (apt-get install prometheus as root): tests/test_alerts.py skips"

## lock: regenerate the image's lock files (requirements/cuda-*.txt) from pyproject.toml and the .in files
lock: $(VENV)/.base
	$(PY) -m pip install -q uv
	for f in requirements/cuda-*.in; do \
	  $(VENV)/bin/uv pip compile pyproject.toml $$f --extra cuda --extra hf --generate-hashes \
	    --python-version 3.12 --python-platform x86_64-manylinux_2_28 --no-header --quiet \
	    -o $${f%.in}.txt || exit 1; \
	done

lint: install-dev
	$(VENV)/bin/ruff check app pool featpool_vllm featpool_sglang tests bench
	$(VENV)/bin/ruff format --check app pool featpool_vllm featpool_sglang tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
