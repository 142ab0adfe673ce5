# remat: `make demo` runs the example, `make test` runs the whole suite.
# Both set up the machine first (scripts/setup.sh, idempotent).
VENV ?= $(HOME)/.cache/remat/venv
BUILD ?= build
JOBS ?= 2
TORCH_PREFIX = $(shell $(VENV)/bin/python -c "import torch.utils; print(torch.utils.cmake_prefix_path)" 2>/dev/null)

.PHONY: setup configure build test demo bench clean
setup:
	@bash scripts/setup.sh

configure: setup
	@cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_PREFIX_PATH="$(TORCH_PREFIX)" -DPython3_EXECUTABLE=$(VENV)/bin/python >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

test: build
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

demo: build
	@$(BUILD)/examples/remat_demo

# bench: remat (C++) against torch.utils.checkpoint (Python) on the same
# LibTorch, ~10 minutes (docs/BENCHMARKS.md). The in-process C++ benchmarks
# still run on their own: $(BUILD)/bench/remat_bench, $(BUILD)/bench/plan/remat_plan_bench.
bench: build
	@$(VENV)/bin/python bench/py/run_all.py --build $(BUILD)

clean:
	rm -rf $(BUILD)
