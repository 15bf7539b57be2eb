# tokenmill: `make serve` and `make test` do all the set-up they need on a fresh machine.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .cache/install.stamp
MODEL ?= smollm2-135m
PROMPT ?= Explain in two sentences what a KV cache is.

.PHONY: install serve generate test test-slow lint typecheck pytest bench clean

# torch comes first and pinned: a plain `torch` would pull several GB of CUDA wheels on CPU machines.
$(STAMP): pyproject.toml
	@mkdir -p .cache
	@if ! $(PYTHON) -c "import torch" 2>/dev/null; then $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e '.[dev]'
	$(PYTHON) -m tokenmill.kernels
	@touch $(STAMP)

install: $(STAMP)

serve: install
	$(PYTHON) -m tokenmill pull $(MODEL)
	$(PYTHON) -m tokenmill serve $(MODEL)

generate: install
	$(PYTHON) -m tokenmill pull $(MODEL)
	$(PYTHON) -m tokenmill generate $(MODEL) --chat "$(PROMPT)"

lint: install
	$(PYTHON) -m ruff check tokenmill tests benchmarks

typecheck: install
	$(PYTHON) -m mypy

# The golden-parity tests need all three architectures (llama, gemma3, qwen2) pulled, else they skip.
GOLDEN_MODELS := smollm2-135m gemma3-270m qwen2.5-coder-0.5b

pytest: install
	@for m in $(GOLDEN_MODELS); do $(PYTHON) -m tokenmill pull --quiet $$m >/dev/null || exit 1; done
	$(PYTHON) -m pytest

test: lint typecheck pytest

test-slow: install
	$(PYTHON) -m pytest -m slow

bench: install
	$(PYTHON) benchmarks/offline_throughput.py --model $(MODEL)
	$(PYTHON) benchmarks/decode_roofline.py --model $(MODEL)
	$(PYTHON) benchmarks/cpu_kernels.py --model $(MODEL)

clean:
	rm -rf .cache .mypy_cache .ruff_cache .pytest_cache
