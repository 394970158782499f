# Every target creates (once) and reuses the virtual environment in .venv/.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test bench

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	$(VENV)/bin/pip install -q --no-deps nixl==1.5.1
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvfabric demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider tests

bench: $(STAMP)
	$(VENV)/bin/kvfabric bench radix
