# vLLM E2: `make image` builds the engine image, `make test` runs every test tier.
PYTHON ?= python3
E2 ?= e2

.PHONY: install verify overlay test test-driver bench

install:
	$(PYTHON) -m pip install -q -e '.[test]'

verify: install
	$(E2) verify

overlay: install
	$(E2) overlay

test: install
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest tests

test-driver: install
	$(PYTHON) -m pytest tests/driver

bench: install
	$(PYTHON) scripts/bench/bench_driver.py
