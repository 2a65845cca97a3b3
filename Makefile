# The two commands of the README, plus what they are built from.
#   make run    set up .venv and run the main job: inverted train on the tiny model (examples/demo.yaml)
#   make test   set up .venv and run the test suite (CPU only, no downloads)
# TORCH is installed first and pinned, so no dependency pulls a multi-GB CUDA build onto a CPU
# machine. On a GPU machine: install your CUDA build of torch into .venv first, then TORCH=skip.

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
TINY   ?= models/tiny-qwen2
MODEL  ?= models/small-qwen2
DEMO_DATA := data/letters.jsonl
# SGLang's own serializer classes, for the weight-payload contract tests: the wheel without its
# GPU dependencies (the tests load only its pure-Python serializer and bucket code).
SGLANG_WIRE ?= sglang==0.5.23
BIN    := $(VENV)/bin

.PHONY: setup run test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(if $(filter skip,$(TORCH)),,$(BIN)/python -m pip install -q "$(TORCH)")
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

$(MODEL)/config.json: $(VENV)/.installed
	$(BIN)/inverted make-tiny-model --out $(MODEL) --arch qwen2 --preset small

$(TINY)/config.json: $(VENV)/.installed
	$(BIN)/inverted make-tiny-model --out $(TINY) --arch qwen2 --preset tiny

$(DEMO_DATA): $(VENV)/.installed
	$(BIN)/python -m envs.letters --out $(DEMO_DATA)

run: setup $(TINY)/config.json $(DEMO_DATA)
	rm -rf runs/demo  # the demo starts fresh each time (a real run resumes with --load)
	$(BIN)/inverted train --config examples/demo.yaml

$(VENV)/.sglang-wire: $(VENV)/.installed
	$(BIN)/python -m pip install -q --no-deps "$(SGLANG_WIRE)"
	touch $@

test: setup $(VENV)/.sglang-wire
	$(BIN)/python -m pytest -q --durations=15  # the slowest tests, to keep the suite within its time

bench: setup $(MODEL)/config.json
	$(BIN)/python bench/engine_throughput.py --model $(MODEL)

clean:
	rm -rf $(VENV) models runs data .pytest_cache
