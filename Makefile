# remat: `make demo` builds and runs the example, `make test` builds and runs the whole suite.
# Both set up the machine first (scripts/setup.sh, idempotent).
VENV ?= $(HOME)/.cache/remat/venv
BUILD ?= build
JOBS ?= 2
TORCH_PREFIX = $(shell $(VENV)/bin/python -c "import torch.utils; print(torch.utils.cmake_prefix_path)" 2>/dev/null)

.PHONY: setup configure build test demo bench bench-quick clean
setup:
	@bash scripts/setup.sh

configure: setup
	@cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_PREFIX_PATH="$(TORCH_PREFIX)" -DPython3_EXECUTABLE=$(VENV)/bin/python >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

test: build
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# demo builds only what the demo runs (remat_demo and the libraries it links),
# not the tests and benchmarks.
demo: configure
	@cmake --build $(BUILD) -j $(JOBS) --target remat_demo
	@$(BUILD)/examples/remat_demo

# bench: remat (C++) against torch.utils.checkpoint (Python) on the same
# LibTorch at the reference CPU sizes (docs/BENCHMARKS.md: GPT 8 x d_model 512, T 512,
# batch 4; MLP 24 x 1024, batch 2048; ResNet 3 stages, width 32, batch 100),
# 2 rounds of 3 timed steps, both workers keeping their freed heap
# (run_all.py --malloc keep), ~33 minutes on the 2 cores, idle
# (docs/BENCHMARKS.md). Results: bench/results/compare.json; then the
# long-context benchmark (bench/py/longctx.py: the GPT training step with a
# 32k vocabulary, ~5 minutes; longctx.json, longctx-py.json); then
# bench/py/gen_docs.py renders the docs' generated tables and
# docs/img/frontier.png from bench/results/. bench-quick: the toy sizes, every
# strategy, ~7 minutes, for smoke runs: bench/results/compare-quick.json (not
# checked in), rendered by gen_docs.py --quick into bench/results/docs-quick/
# (never into docs/). The in-process C++ benchmarks still run on their own:
# $(BUILD)/bench/remat_bench, $(BUILD)/bench/plan/remat_plan_bench.
bench: build
	@$(VENV)/bin/python bench/py/run_all.py --build $(BUILD)
	@$(VENV)/bin/python bench/py/gen_docs.py

bench-quick: build
	@$(VENV)/bin/python bench/py/run_all.py --build $(BUILD) --quick
	@$(VENV)/bin/python bench/py/gen_docs.py --quick

clean:
	rm -rf $(BUILD)

# --- Reliability checks (docs/RELIABILITY.md) --------------------------------
# test-asan / test-tsan: remat's own targets instrumented (REMAT_SANITIZE, in
# cmake/sanitize.cmake), LibTorch as shipped. -O1: ASan's recommendation (fast
# enough, stacks still readable); asserts stay on (no NDEBUG). Examples and
# benchmarks are not built. SAN_TESTS="remat_plan_tests test_hooks" builds only
# those test binaries and runs only their tests (ctest labels = binary names);
# empty: everything.
SAN_TESTS ?=
# SAN_EXCLUDE: GoogleTest tests not to run in the sanitizer build, as a
# GTEST_FILTER list (Suite.Name:Suite.Other, wildcards allowed): each ctest
# test is a whole binary (remat_gtest in CMakeLists.txt), run with
# GTEST_FILTER=-$(SAN_EXCLUDE).
SAN_EXCLUDE ?=
SAN_CONFIGURE = cmake -S . -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 \
  -DREMAT_BUILD_EXAMPLES=OFF -DREMAT_BUILD_BENCH=OFF \
  -DCMAKE_PREFIX_PATH="$(TORCH_PREFIX)" -DPython3_EXECUTABLE=$(VENV)/bin/python
san_empty :=
san_space := $(san_empty) $(san_empty)
SAN_CTEST_FILTER = $(if $(strip $(SAN_TESTS)),-L '^($(subst $(san_space),|,$(strip $(SAN_TESTS))))$$')
SUPP = $(CURDIR)/cmake/sanitizers
# Why each option (they are exported to the build too: with
# REMAT_CTEST_PER_TEST=ON, gtest_discover_tests runs every test binary once
# at build time to list its tests):
#  detect_leaks=1: leaks are findings. LibTorch is not instrumented, but LSan
#    still sees its allocations; none leaked in our runs, so the suppressions
#    file (cmake/sanitizers/lsan.supp) is empty: add "leak:libtorch_cpu.so"
#    lines there, with the report, rather than turning detection off;
#  halt_on_error=1, abort_on_error=0: the first finding ends the process with
#    a non-zero status (no core dump), so the test fails; UBSan also needs
#    -fno-sanitize-recover=all at compile time (cmake/sanitize.cmake);
#  detect_stack_use_after_return=1: catches a lambda or hook keeping a
#    reference to a dead stack frame (checkpoint regions capture by reference);
#  print_stacktrace=1: UBSan prints no stack by default.
ASAN_ENV = ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:abort_on_error=0:detect_stack_use_after_return=1 \
  LSAN_OPTIONS=suppressions=$(SUPP)/lsan.supp:print_suppressions=0 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:suppressions=$(SUPP)/ubsan.supp
#  TSan: second_deadlock_stack=1 for lock-order reports; suppressions for races
#  TSan cannot judge inside the uninstrumented LibTorch (cmake/sanitizers/tsan.supp).
TSAN_ENV = TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$(SUPP)/tsan.supp
# test-tsan runs the thread tests (GoogleTest tests whose name contains Thread).
TSAN_GTEST_FILTER ?= *Thread*

.PHONY: test-asan test-tsan fuzz format format-fix
test-asan: setup
	@$(SAN_CONFIGURE) -B build-asan -DREMAT_SANITIZE=address,undefined >/dev/null
	@$(ASAN_ENV) cmake --build build-asan -j $(JOBS) $(if $(strip $(SAN_TESTS)),--target $(SAN_TESTS))
	@cd build-asan && $(ASAN_ENV) $(if $(strip $(SAN_EXCLUDE)),GTEST_FILTER='-$(strip $(SAN_EXCLUDE))') \
	  ctest --output-on-failure -j $(JOBS) $(SAN_CTEST_FILTER)

test-tsan: setup
	@$(SAN_CONFIGURE) -B build-tsan -DREMAT_SANITIZE=thread >/dev/null
	@$(TSAN_ENV) cmake --build build-tsan -j $(JOBS) $(if $(strip $(SAN_TESTS)),--target $(SAN_TESTS))
	@cd build-tsan && $(TSAN_ENV) GTEST_FILTER='$(TSAN_GTEST_FILTER)' ctest --output-on-failure -j $(JOBS) $(SAN_CTEST_FILTER)

# fuzz: libFuzzer targets of fuzz/ (clang), FUZZ_SECONDS each (scripts/fuzz.sh).
FUZZ_SECONDS ?= 60
fuzz:
	@bash scripts/fuzz.sh $(FUZZ_SECONDS)

# format: check the tree against .clang-format; format-fix: rewrite it.
format:
	@bash scripts/format-check.sh
format-fix:
	@bash scripts/format-check.sh --fix

# docs: the API reference, Doxygen over the public headers (Doxyfile), HTML in
# $(BUILD)/docs/html; fails when Doxygen's warnings (undocumented public
# symbols) go above the baseline in docs/api-warnings.txt (scripts/api-docs.sh).
# Needs only doxygen (installed when missing), not LibTorch or a build.
.PHONY: docs
docs:
	@bash scripts/api-docs.sh $(BUILD)/docs
