# Quick start: `make serve` (HTTP :8000 + gRPC :8001 on the embedded demo model), `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU machines: pinned torch/torchvision from the local wheel store. GPU machines: `make TORCH_SPEC= serve`
# keeps the system's torch (the venv then sees the system site-packages).
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1

# constraints.txt is the lock (the versions the tests ran with; docs/deploy.md, "The lock"): every install goes
# through it. torch is not in it (TORCH_SPEC or the system's torch decides); `pip install mmserve` keeps ranges.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(if $(TORCH_SPEC),,--system-site-packages) $(VENV)
	$(PY) -m pip install -q -c constraints.txt --upgrade pip
	$(if $(TORCH_SPEC),$(PY) -m pip install -q -c constraints.txt $(TORCH_SPEC))
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
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
