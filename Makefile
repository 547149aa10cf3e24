# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing and installs what it needs, torch first (a CPU build here:
# a later unpinned `torch` requirement is then already satisfied and never pulls CUDA).
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
DEPS := $(VENV)/.deps-installed
NATIVE := $(VENV)/.native-built

PY_FILES := $(VENV)/.py-files

.PHONY: demo test unit native jobs check lint docs bench clean wheel-check FORCE

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

# The package's module list: the editable install maps each module to its file, so a module
# added, moved or removed needs a reinstall, as a changed C source does.
$(PY_FILES): FORCE | $(VPY)
	@find ccld_plugin ccld_harness -name '*.py' | sort > $@.new
	@cmp -s $@.new $@ || mv $@.new $@
	@rm -f $@.new

# Rebuild the native probe when its sources change.
$(NATIVE): $(DEPS) CMakeLists.txt $(wildcard ccld_plugin/csrc/*) $(wildcard startup/*) $(PY_FILES)
	$(VPY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

demo: $(NATIVE)
	$(VENV)/bin/ccld demo

# Everything: unit, native and jobs tiers (real multi-process jobs: 35-45 minutes on 2 cores).
test: $(NATIVE)
	$(VPY) -m pytest -q --durations=15

# Synthetic analysis tests, in-process, seconds.
unit: $(NATIVE)
	$(VPY) -m pytest -q tests/unit

native: $(NATIVE)
	$(VPY) -m pytest -q tests/native

jobs: $(NATIVE)
	$(VPY) -m pytest -q tests/jobs

LINTED := ccld_plugin ccld_harness startup tests benchmarks examples tools

# Lint, format and types.
check: $(NATIVE)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy

lint: check

# The documentation site, strictly (a broken link or a page missing from the nav fails),
# after checking that the generated reference pages are the code's.
docs: $(NATIVE)
	$(VPY) tools/reference_pages.py --check
	$(VENV)/bin/mkdocs build --strict --quiet

# The wheel as a user gets it: built, installed into a fresh venv outside the tree (torch
# first), then ccld demo, ccld run and ccld diagnose from another folder (~3-4 min).
wheel-check: $(NATIVE)
	$(PYTHON) tools/wheel_check.py --build-python $(VPY) --torch "$(TORCH_SPEC)"

bench: $(NATIVE)
	$(VPY) benchmarks/hook_overhead.py

clean:
	rm -rf build demo-out .pytest_cache
