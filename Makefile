# Every target creates (once) and reuses the virtual environment in .venv/.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test side-checks pure-core bench sanitize

REQ := requirements

# vLLM (the CPU build) goes in beside torch, Ray and NIXL: its requirements without the
# torch family, then three wheels with --no-deps (see requirements/*.txt for why).
# The install builds the C extensions (setup.py, core/*/csrc/, transport/csrc/) in
# place: a change to their sources installs again.
NATIVE_SRC := setup.py $(wildcard core/*/csrc/*.c core/*/csrc/*.h transport/csrc/*.c)

$(STAMP): pyproject.toml Makefile $(REQ)/constraints.txt $(REQ)/vllm.txt $(REQ)/vllm-nodeps.txt $(NATIVE_SRC)
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -c $(REQ)/constraints.txt -e '.[test,demo]'
	$(VENV)/bin/pip install -q --no-deps nixl==1.5.1
	$(VENV)/bin/pip install -q -c $(REQ)/constraints.txt -r $(REQ)/vllm.txt
	$(VENV)/bin/pip install -q --no-deps -c $(REQ)/constraints.txt -r $(REQ)/vllm-nodeps.txt
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvfabric demo --json

# The suite runs on the native path (KVF_NATIVE's default). Beside it, on the second core,
# run the checks that start no Ray cluster of the suite's kind and read the tree only
# through copies: types, packaging, C style, layers, the benches (each its own throwaway
# Ray or none), the oldest NIXL, the deploy tests that start no Ray, SGLang's radix, the
# core's tests, and the sanitizers. Not the transport's: their staging files in /dev/shm
# sit where the suite's node actors scan for engine records (an engine-watch test failed
# once beside them; not reproduced since). The actors' tests and the reference chaos run
# there too (their own Ray clusters; named actors are per cluster, Serve apps on free
# ports), all but the engine watch, which scans /dev/shm. After the suite, on its core,
# the core's tests run again on the pure-Python reference (pure-core). A clean-clone CI of
# a0ab5bc on this 2-core machine took 45.2 min: the suite's lane 37.6 min then the
# pure-Python core 1.8, the side's 36.1 then the pure-Python core and the sanitizers;
# the pure-Python core moved lanes to even them. One of c7e3aec took 28.8 min (install
# 3.5, the suite 24.9 then the pure-Python core 0.9; the side 22.0 then the sanitizers),
# on a quieter machine. Their output follows the suite's; either failing fails the
# target. Both lanes print their slowest tests, to see where time goes.
SIDE := tests/test_types.py tests/test_install.py tests/test_c_style.py tests/test_layers.py \
	tests/test_benches.py tests/transport/test_nixl_versions.py tests/deploy/test_peer_radix.py \
	tests/actors/fabric_cluster $(filter-out tests/actors/test_engine_watch.py,$(wildcard tests/actors/test_*.py)) \
	tests/deploy/test_chaos.py \
	$(addprefix tests/deploy/test_,$(addsuffix .py,dashboard fuzz_tenants http_replay \
	ingress_auth model_engine put_rows replay replay_tiers replicate stats tenants tokenizer trace)) \
	tests/core
test: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	@mkdir -p .cache
	@$(MAKE) --no-print-directory side-checks > .cache/side-checks.log 2>&1 & side=$$!; \
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=25 tests $(SIDE:%=--ignore=%); main=$$?; \
	$(MAKE) --no-print-directory pure-core; pure=$$?; \
	wait $$side; rc=$$?; echo "--- the side checks (exit $$rc):"; cat .cache/side-checks.log; \
	test $$main -eq 0 -a $$pure -eq 0 -a $$rc -eq 0

side-checks: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=25 $(SIDE)
	$(MAKE) sanitize

# The core's tests on the pure-Python reference (no C extension loaded).
pure-core: $(STAMP)
	KVF_NATIVE=0 $(VENV)/bin/python -m pytest -q -p no:cacheprovider tests/core

# The C extensions built again with AddressSanitizer and UBSan, in a copy of the tree (the
# installed ones stay optimised), and the native differential tests run on them: a
# primitive that reads or writes memory it does not own fails here, not only one that
# answers wrong. Time-boxed, on the `sanitize` profile's fewer examples (a sanitized run is
# about ten times slower); leaks are not checked (CPython keeps its own at exit).
SAN := .cache/sanitize
SAN_CFLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g
SAN_LIBS = $(shell gcc -print-file-name=libasan.so):$(shell gcc -print-file-name=libubsan.so)
sanitize: $(STAMP)
	rm -rf $(SAN) && mkdir -p $(SAN)
	tar -c --exclude='*.so' --exclude=__pycache__ setup.py pyproject.toml LICENSE kvfabric core transport actors deploy tests | tar -x -C $(SAN)
	cd $(SAN) && CFLAGS="$(SAN_CFLAGS)" ../../$(VENV)/bin/python setup.py -q build_ext --inplace 2>build.log || (cat build.log; exit 1)
	cd $(SAN) && KVF_SANITIZE=1 KVF_HYPOTHESIS=sanitize LD_PRELOAD=$(SAN_LIBS) PYTHONMALLOC=malloc ASAN_OPTIONS=detect_leaks=0 \
		UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 timeout 900 ../../$(VENV)/bin/python \
		-m pytest -q -p no:cacheprovider tests/core/test_native_*.py tests/core/test_sanitized.py \
		tests/transport/test_native_plan.py

bench: $(STAMP)
	$(VENV)/bin/kvfabric bench radix
