# The two commands a new user needs: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU build of torch on machines without CUDA; an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install run test test-quick docs clean model kernels redis tcmalloc checkov gpu-carry gpu-check

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[triton,test,bench,docs]"
	touch $(STAMP)

install: $(STAMP)

# apt waits for another apt (an unattended upgrade, a parallel make) instead of failing on its lock.
APT_GET := DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300

# A private redis-server is started by the tests and by `make run`; install it if missing.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server with apt"; \
		$(APT_GET) update -qq && $(APT_GET) install -y -qq redis-server >/dev/null; }

# Worker processes run on tcmalloc where it is installed (splitserve/cli/allocator.py: ~8 % more tok/s).
tcmalloc:
	@ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal || { \
		echo "installing libtcmalloc-minimal4 with apt"; \
		$(APT_GET) update -qq && $(APT_GET) install -y -qq libtcmalloc-minimal4 >/dev/null; }

# checkov (tests/deploy/test_kubernetes.py lints deploy/kubernetes with it) pins many dependencies of
# its own: a venv of its own, so it cannot change what the project's venv holds.
CHECKOV_VENV ?= .venv-checkov
CHECKOV_SPEC ?= checkov==3.3.30
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed-$(subst =,-,$(CHECKOV_SPEC))

$(CHECKOV_STAMP):
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q --upgrade pip
	$(CHECKOV_VENV)/bin/python -m pip install -q "$(CHECKOV_SPEC)"
	touch $(CHECKOV_STAMP)

checkov: $(CHECKOV_STAMP)

model: install
	$(PY) -m splitserve.engine.model_loader smollm2-135m-instruct

# The CPU attention kernels, compiled once for this machine (otherwise at the first engine start).
kernels: install
	$(PY) -m splitserve.engine.attention.cpu_kernels

# Brings the whole stack up (Redis, gateway, one prefill and one decode worker: given, since up
# alone runs one colocated worker on fewer than 4 cores), asks one question through it and shuts down. `$(VENV)/bin/splitserve up` keeps it serving. The model
# is served in the 4-bit codes it ships in (--quantization gguf: its weights take 106 MiB, not
# 621 MiB as float32; docs/models.md#quantized-weights).
run: model kernels redis tcmalloc
	$(VENV)/bin/splitserve up --prefill 1 --decode 1 --quantization gguf --demo "What is the capital of France? Answer in one sentence."

# Triton kernels are interpreted on CPU tensors only where no GPU can compile them (tests/conftest.py).
# Files go out longest first (tests/conftest.py, tests/file_seconds.json): xdist would otherwise
# reorder them by their number of tests.
test: install model kernels redis tcmalloc checkov
	CHECKOV="$(CURDIR)/$(CHECKOV_VENV)/bin/checkov" $(PY) -m pytest -q -ra --durations=30 -n 2 --dist loadfile --no-loadscope-reorder

# The inner loop: the tests that start no process of their own and load no real model
# (tests/conftest.py marks the others), a few minutes.
test-quick: install model kernels
	$(PY) -m pytest -q -ra -m "not processes and not slow" --durations=10

# The documentation site (docs/, mkdocs.yml) into site/; --strict fails on a broken link or anchor.
# The two variables silence mkdocs-material's and mkdocs' banners about MkDocs 2.
docs: install
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(PY) -m mkdocs build --strict -d site

# The GPU path, checked once on a GPU machine that has no network (docs/engine.md, "On GPUs").
# gpu-carry, here: what that machine lacks, into .gpu-carry/ (git-ignored; carry it along).
# gpu-check, there: its own python3 with torch/triton/transformers, plus what was carried.
GPU_PYTHON ?= python3
gpu-carry: install model redis
	$(PY) -m bench.gpu_carry

gpu-check:
	PATH="$(CURDIR)/.gpu-carry/bin:$$PATH" PYTHONPATH="$(CURDIR)/.gpu-carry/site:$(CURDIR)" TRITON_INTERPRET=0 \
		$(GPU_PYTHON) -m bench.gpu_check --out bench/results/gpu_check.json

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) build *.egg-info
