# Two commands on a fresh machine: `make up` and `make test`. Both install what is missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: up test test-quick check lint browser promtool bytecode console-assets test-drills test-sglang accel bench bench-routing bench-capacity bench-autoscale bench-batch bench-lora bench-pd bench-pd-sim bench-pd-autoscale install clean help

help:
	@echo "make up     run the whole platform locally (simulated GPUs); Ctrl-C stops it"
	@echo "make test   install what is missing and run the test suite (lint, types and package layers included)"
	@echo "make test-quick  the development loop (30-80 s): make lint, then the tests marked neither e2e nor slow (no process started); make check is the same"
	@echo "make lint   only ruff, mypy (every package) and the package layers (lint-imports)"
	@echo "make test-sglang  the engine contract suite against real SGLang 0.5.23 on CPU (installs ~11 GB into ~/.cache/inferbus once)"
	@echo "make bench  the serving spine side by side with sglang-router (~4 min, ARGS=--quick ~1.5 min), then admission, fairness, billing, placement, overload (~7 min); writes bench/results/"
	@echo "make bench-routing  replay two Mooncake traces through sglang-router, Dynamo (KV, round-robin) and inferbus affinity (~15 min), then our simulator against Dynamo's replay (~5 min); writes bench/results/routing*.* and simulate_vs_dynamo.*"
	@echo "make bench-capacity  plan the worked example, tight-and-right check, simulator speed and validation, sweep vs aiperf (~30 min); writes bench/results/"
	@echo "make bench-autoscale  the autoscaler against a static fleet and a threshold policy in the simulator (~1 CPU-hour)"
	@echo "make bench-lora  200 and 1,000 LoRA adapters (Zipf) against the base model on 4 simulated workers (~30 min); writes bench/results/lora.*"
	@echo "make bench-pd  aggregated against disaggregated (prefill/decode): the plan's choice in the fleet simulator (bench-pd-sim, a few CPU-min) and live on the same simulated GPUs; writes bench/results/pd.* and pd_live.*"
	@echo "make bench-pd-sim  the fleet-simulator part of bench-pd alone (bench/pd.py)"
	@echo "make bench-pd-autoscale  a disaggregated fleet, static against each pool autoscaled on its own signal, over a diurnal ramp in the fleet simulator (~3 CPU-min); writes bench/results/pd_autoscale.*"
	@echo "make bench-batch  interactive latency with and without a large batch: simulator at fleet scale (~15 CPU-min) and live; writes bench/results/batch.*"
	@echo "make console-assets  re-vendor the web console's Chart.js and Pico CSS from npm (package-lock.json; needs Node.js)"
	@echo "make clean  remove the virtualenv and local state"

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall when the dependency list changes. uv installs the same packages as pip in a fraction of
# the time (parallel downloads and bytecode compilation): 0.7 against 1.7 minutes on 2 idle cores.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet uv
	$(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) -e '.[dev]'
	@touch $(STAMP)

# The fleet simulator's hot modules compiled with mypyc (tools/capacity/accel.py), rebuilt when their
# source changed; without a current build they run as Python, two to three times slower.
accel: $(STAMP)
	@$(PY) -m tools.capacity.accel build --if-stale --warn-only

install: $(STAMP) accel promtool bytecode

# Our own modules compiled to bytecode ahead (a second when current). Where PYTHONDONTWRITEBYTECODE
# is set, as on CI's machines, every process would otherwise compile each module it imports again:
# 0.2 s of CPU for each service a platform starts.
bytecode: $(STAMP)
	@$(PY) -m compileall -q -j 0 inferbus services proto tools bench >/dev/null

# promtool (Prometheus's rule checker) for the PromQL checks of tests/test_deploy.py, into the
# virtualenv: the system's if installed, else the binary out of Debian's `prometheus` package
# (`apt-get download`: no server installed or started). Without apt-get the checks are skipped.
promtool: $(VENV)/bin/promtool
$(VENV)/bin/promtool: | $(PY)
	@if command -v promtool >/dev/null 2>&1; then ln -sf "$$(command -v promtool)" $@; \
	elif command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1; then \
	  echo "fetching promtool (Debian package prometheus) for the PromQL checks"; \
	  tmp=$$(mktemp -d) && chmod 755 $$tmp && \
	  { (cd $$tmp && apt-get download -qq prometheus >/dev/null 2>&1) || \
	    { $(SUDO) apt-get update -qq && (cd $$tmp && apt-get download -qq prometheus >/dev/null 2>&1); }; } && \
	  dpkg-deb --fsys-tarfile $$tmp/prometheus_*.deb | tar -x -C $$tmp ./usr/bin/promtool && \
	  mv $$tmp/usr/bin/promtool $@ || echo "could not fetch promtool: the PromQL checks will be skipped"; \
	  rm -rf $$tmp; \
	else echo "no promtool and no apt-get: the PromQL checks will be skipped"; fi

up: install
	$(VENV)/bin/inferbus up $(ARGS)

# The 25 slowest tests close the report: where the suite's time goes, run after run.
# Two test processes (pytest-xdist), each taking whole modules (`--dist loadfile`: a module's
# platform fixture starts once), about 1.5x faster on 2 cores (README, "Test tiers");
# TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2
test: install browser
	$(PY) -m pytest -q -rx -p no:cacheprovider --durations=25 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The development loop (25 s of CPU: 31 s on 2 cores at load 3, 80 s at load 9): `make lint`
# (mypy's cache makes it a few seconds after the first run's ~25 s), then the tests that start no
# process and take well under a second each: not marked e2e or slow (tests/test_toolchain.py fails
# when a test that starts a process is not marked). The e2e modules are not even collected: their
# imports alone cost seconds. `make test` still runs everything, CI too.
test-quick: lint
	$(PY) -m pytest -q -p no:cacheprovider -m "not e2e and not slow" --ignore=tests/sglang --ignore-glob='tests/test_e2e_*' $(PYTEST_ARGS)

check: test-quick

# The web console's browser tests (tests/test_e2e_console.py) drive Debian's Chromium through
# Playwright (never `playwright install`, which downloads a browser of its own): installed here
# when missing, with apt-get (as root, else through sudo).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  if command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium for the console's browser tests"; \
	    $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver >/dev/null; \
	  else echo "no chromium and no apt-get: the console's browser tests will be skipped (set INFERBUS_CHROMIUM)"; fi

# The console's browser libraries are committed (services/gateway/console/static/vendor) so that
# the gateway needs no build step; this refreshes them from the versions package-lock.json pins.
console-assets:
	cd services/gateway/console && npm ci --ignore-scripts --no-audit --no-fund && npm run vendor

# The checks tests/test_toolchain.py runs in `make test`, alone and with their own output.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

# Failure drills on the 3-zone local platform (tests/test_e2e_drills.py, `inferbus drill`).
test-drills: install
	INFERBUS_DRILLS=1 $(PY) -m pytest -q -p no:cacheprovider -m drill tests/test_e2e_drills.py tests/test_e2e_pd_drills.py $(PYTEST_ARGS)

# The contract suite (tests/sglang) against real SGLang instead of the simulated engine. SGLang,
# the tiny model and its adapters are cached under $INFERBUS_CACHE (default ~/.cache/inferbus).
test-sglang: $(STAMP)
	@home="$$(tests/sglang/install.sh)" && \
	  INFERBUS_CONTRACT_ENGINE=sglang INFERBUS_SGLANG_HOME="$$home" \
	  $(PY) -m pytest -q -p no:cacheprovider tests/sglang $(PYTEST_ARGS)

# bench.spine installs sglang-router into the venv on first use (as bench-routing does); ARGS go to it.
bench: install
	$(PY) -m bench.spine $(ARGS)
	$(PY) -m bench.admission
	$(PY) -m bench.fairness
	$(PY) -m bench.billing
	$(PY) -m bench.placement
	$(PY) -m bench.overload

# Installs sglang-router and matplotlib into the venv, and NVIDIA Dynamo into .venv-dynamo, on
# first use (not core dependencies). Live: ~15 min for both traces; then the simulators (~5 min).
bench-routing: install
	$(PY) -m bench.routing --sample-families 0.15 $(ARGS)
	$(PY) -m bench.routing --trace mooncake_conversation.jsonl --sample-families 1 --requests 250 --name routing_conversation $(ARGS)
	$(PY) -m bench.simulate_vs_dynamo

# The capacity tools' numbers: the planner's worked example (with what FP8, speculative decoding
# and LoRA change), the tight-and-right check of the planned fleet, the simulator's speed, its agreement
# with the per-step simulator and a static day, and `inferbus sweep` against aiperf (installed
# into .venv-aiperf on first use).
bench-capacity: install
	$(PY) -m bench.plan
	$(PY) -m bench.tight_and_right
	$(PY) -m bench.simulate
	$(PY) -m bench.sweep_vs_aiperf

bench-autoscale: install
	$(PY) -m bench.autoscale $(ARGS)

bench-batch: install
	$(PY) -m bench.batch $(ARGS)

bench-lora: install
	$(PY) -m bench.lora $(ARGS)

# The plan's topology choice against the fleet simulator (bench/pd.py): goodput per GPU of both
# topologies on the same GPUs and tight-and-right for each planned fleet, long-prompt and conversation traces.
bench-pd-sim: install
	$(PY) -m bench.pd $(SIM_ARGS)

bench-pd-autoscale: install
	$(PY) -m bench.pd_autoscale $(SIM_ARGS)

# Aggregated against disaggregated on the same GPUs, live on simulated engines (bench/pd_live.py): the
# Mooncake synthetic and conversation traces, 4 H100 TP2 engines against 3 prefill + 1 decode
# (~15 min on 2 cores); LIVE_ARGS go to both runs.
bench-pd: bench-pd-sim
	$(PY) -m bench.pd_live --prefill 3 --load 0.5 $(LIVE_ARGS)
	$(PY) -m bench.pd_live --prefill 3 --load 0.5 --trace mooncake_conversation.jsonl --sample-families 1 --name pd_live_conversation $(LIVE_ARGS)

clean:
	rm -rf $(VENV) .inferbus .accel
