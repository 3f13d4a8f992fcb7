# Entry points. `make run` and `make test` work on a fresh Debian machine:
# they install the Debian packages kdacp needs, build, and run.
.PHONY: deps venv build build-sanitize build-tsan sanitizer-builds run test test-release test-sanitize test-tsan fuzz simulate clean

JOBS ?= $(shell nproc)

deps:
	bash scripts/install-deps.sh

# The Python tests' environment: build/venv with torch 2.x and flash-linear-attention
# from PyPI, pinned in scripts/python-constraints.txt; built once, then reused
# (scripts/python-env.sh). Configuring after it lets CMake run the python.* tests
# there (Debian's torch keeps the python_debian.* smoke tests).
venv: deps
	bash scripts/python-env.sh

build: deps
	cmake --preset release
	cmake --build --preset release -j $(JOBS)

build-sanitize: deps
	cmake --preset sanitize
	cmake --build --preset sanitize -j $(JOBS)

build-tsan: deps
	cmake --preset tsan
	cmake --build --preset tsan -j $(JOBS)

# The main job on in-process ranks.
run: build
	./build/release/tools/kdacp run

test-release: venv build
	ctest --preset release

# The state exchange on simulated clusters (SimGrid SMPI; docs/scale.md):
# every protocol configuration at P = 8..1024 on platforms/, beside the cost
# model, folded (memory shared, fold steps charged as flops); table, JSON and
# plot in build/simulate/. A benchmark of several hours on 2 cores;
# SIMULATE_ARGS='--knobs best' runs each protocol's best knob only.
SIMULATE_ARGS ?=
simulate: build
	/usr/bin/python3 scripts/simulate.py --out build/simulate $(SIMULATE_ARGS)

# The in-process suite under ASan + UBSan, and each libFuzzer target (.npy
# reader, calibration JSON, numeric flag parser) for 12 s each plus a replay
# of fuzz/regressions.
test-sanitize: build-sanitize
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --preset sanitize

# The fuzz targets for longer (FUZZ_SECONDS each); new inputs stay in the build
# tree, crashes are written to build/sanitize/fuzz/artifacts/.
FUZZ_SECONDS ?= 600
fuzz: build-sanitize
	for t in npy cost_json units; do \
	  ./build/sanitize/fuzz/kdacp_fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -timeout=10 \
	    -rss_limit_mb=2048 -artifact_prefix=build/sanitize/fuzz/artifacts/$$t- \
	    build/sanitize/fuzz/corpus/$$t fuzz/corpus/$$t || exit 1; \
	done

# The whole in-process suite (kdacp_tests, ctest label "inprocess") under
# ThreadSanitizer: every rank is a thread, so this is where races show. It
# builds and runs only kdacp_tests. Excluded: the CLI, interop and bench
# tests, which drive the same library code through the kdacp executable (the
# bench and calibrate ones measure time, which TSan stretches 5-15x), the
# installed-package check, and the MPI tests (one rank per process, no MPI in
# this build). TSAN_OPTIONS comes from the test preset.
test-tsan: build-tsan
	ctest --preset tsan

# The sanitizer builds compile the SIMD kernels for the baseline target only
# (HWY_COMPILE_ONLY_STATIC): they check memory and threads, not the per-target
# arithmetic, which the release suite tests on every compiled target; it keeps
# make test within its time on a 2-core machine. They carry line tables only
# (-gline-tables-only: file and line in every report, ~10 % less compile time
# than full debug information), the tests', the CLI's and the report writers'
# own code compiles at -O0 there (the library stays -O2), and kdacp_tests
# runs some sweeps on fewer points (KDACP_SANITIZER_BUILD, tests/CMakeLists.txt).
# They compile listed groups of five or six sources as one translation unit
# each (KDACP_UNITY=ALL, cmake/KdacpUnity.cmake): one parse and one
# instrumented copy of the headers' inline code per group, 36-63 % less time
# per group. The release build groups only the tests' and the CLI's files
# (LEAF): the library's compile alone there, so each still stands on its own.

# Every test: the release build (g++), then the in-process suite under
# AddressSanitizer + UndefinedBehaviorSanitizer and under ThreadSanitizer
# (clang). The two sanitizer builds compile at low priority while the release
# suite runs: its MPI and Python tests leave the cores idle while they wait on
# their processes, and every test keeps its own timeout. Output is synced by
# line. The Python tests' environment (make venv: on a fresh checkout a download of
# about 3 GB, 1.5 minutes here) installs while the release build compiles; the
# configure that test-release repeats then finds it.
test:
	$(MAKE) --no-print-directory -j 2 --output-sync=line venv build
	$(MAKE) --no-print-directory -j 2 --output-sync=line test-release sanitizer-builds
	$(MAKE) --no-print-directory test-sanitize test-tsan

sanitizer-builds: deps
	nice -n 10 $(MAKE) --no-print-directory build-sanitize build-tsan

clean:
	rm -rf build
