# Every target creates (once) and reuses the virtual environment in .venv/.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test bench

REQ := requirements

# vLLM (the CPU build) goes in beside torch, Ray and NIXL: its requirements without the
# torch family, then three wheels with --no-deps (see requirements/*.txt for why).
# The install builds the C extensions (setup.py, fabric/*/csrc/) in place: a change to
# its sources installs again.
NATIVE_SRC := setup.py $(wildcard fabric/cache/csrc/*.c fabric/cache/csrc/*.h fabric/index/csrc/*.c fabric/index/csrc/*.h)

$(STAMP): pyproject.toml Makefile $(REQ)/constraints.txt $(REQ)/vllm.txt $(REQ)/vllm-nodeps.txt $(NATIVE_SRC)
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -c $(REQ)/constraints.txt -e '.[test]'
	$(VENV)/bin/pip install -q --no-deps nixl==1.5.1
	$(VENV)/bin/pip install -q -c $(REQ)/constraints.txt -r $(REQ)/vllm.txt
	$(VENV)/bin/pip install -q --no-deps -c $(REQ)/constraints.txt -r $(REQ)/vllm-nodeps.txt
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvfabric demo

# The suite runs on the native path (KVF_NATIVE's default); the core's tests run again on
# the pure-Python reference.
test: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider tests
	KVF_NATIVE=0 $(VENV)/bin/python -m pytest -q -p no:cacheprovider tests/fabric

bench: $(STAMP)
	$(VENV)/bin/kvfabric bench radix
