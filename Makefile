# Entry points. `make run` and `make test` work on a fresh Debian machine:
# they install the Debian packages kdacp needs, build, and run.
.PHONY: deps build build-sanitize run test test-release test-sanitize clean

JOBS ?= $(shell nproc)

deps:
	bash scripts/install-deps.sh

build: deps
	cmake --preset release
	cmake --build --preset release -j $(JOBS)

build-sanitize: deps
	cmake --preset sanitize
	cmake --build --preset sanitize -j $(JOBS)

# The main job on in-process ranks.
run: build
	./build/release/tools/kdacp run

test-release: build
	ctest --preset release

test-sanitize: build-sanitize
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --preset sanitize

# Every test: the release build (g++) and the in-process suite under
# AddressSanitizer + UndefinedBehaviorSanitizer (clang).
test: test-release test-sanitize

clean:
	rm -rf build
