# Quick start: `make serve` (HTTP :8000 + gRPC :8001 on the embedded demo model), `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU machines: pinned torch/torchvision from the local wheel store. GPU machines: `make TORCH_SPEC= serve`
# keeps the system's torch (the venv then sees the system site-packages).
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(if $(TORCH_SPEC),,--system-site-packages) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(PY) -m pip install -q $(TORCH_SPEC))
	$(PY) -m pip install -q -e ".[test]"
	touch $@

.PHONY: install serve test test-gpu demo lint
install: $(VENV)/.installed

serve: install
	$(VENV)/bin/mmserve serve $(ARGS)

demo: install
	$(PY) -m mmserve.entrypoints.demo

lint: install
	$(VENV)/bin/ruff check mmserve tests scripts
	$(VENV)/bin/ruff format --check mmserve tests scripts

test: install
	$(PY) -m pytest -q -p no:cacheprovider tests $(ARGS)

test-gpu: install
	$(PY) -m pytest -q -p no:cacheprovider -m gpu tests $(ARGS)
