# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing and installs what it needs, torch first (a CPU build here:
# a later unpinned `torch` requirement is then already satisfied and never pulls CUDA).
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
DEPS := $(VENV)/.deps-installed
NATIVE := $(VENV)/.native-built

.PHONY: demo test lint bench clean

$(VPY):
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

$(DEPS): pyproject.toml | $(VPY)
	$(VPY) -m pip install -q "$(TORCH_SPEC)"
	$(VPY) -c "import torch; print(torch.__version__)" > $(VENV)/.torch-version
	$(VPY) -m pip install -q scikit-build-core nanobind ninja
	$(VPY) -m pip install -q --no-build-isolation -e ".[dev]"
	@$(VPY) -c "import torch; v = open('$(VENV)/.torch-version').read().strip(); \
	  assert torch.__version__ == v, f'torch was replaced: {v} -> {torch.__version__}'"
	touch $@ $(NATIVE)

# Rebuild the native probe when its sources change.
$(NATIVE): $(DEPS) CMakeLists.txt $(wildcard ccld_plugin/csrc/*)
	$(VPY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

demo: $(NATIVE)
	$(VENV)/bin/ccld demo

test: $(NATIVE)
	$(VPY) -m pytest -q

lint: $(NATIVE)
	$(VENV)/bin/ruff check ccld_plugin tests benchmarks examples

bench: $(NATIVE)
	$(VPY) benchmarks/hook_overhead.py

clean:
	rm -rf build demo-out .pytest_cache
