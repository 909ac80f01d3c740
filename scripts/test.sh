#!/usr/bin/env bash
# Runs every test of grpc-rdma on a Debian 12 machine, setting it up first
# (packages, gRPC source, build): README's test command, and what CI runs.
#
#   1. scripts/setup.sh, then the whole CTest suite in build/: softverbs'
#      own tests over both of its wires, and unmodified rdma-core and
#      perftest programs over softverbs, on loopback and between two network
#      namespaces (needs root for `ip netns`);
#   2. the library-only build and its Debian package (scripts/package.sh,
#      in build-deb/): it must build, and the package must hold the library
#      and pin the installed libgrpc (the suite's package test checks the
#      contents of the same package built from build/);
#   3. the same suite again in build-asan/, built with AddressSanitizer and
#      UndefinedBehaviorSanitizer;
#   4. softverbs, the engine and their tests built with ThreadSanitizer in
#      build-tsan/, abseil rebuilt instrumented, and Debian's RDMA programs
#      run on that softverbs (scripts/tsan.sh).
#
# Environment: GRPC_RDMA_SKIP_SANITIZERS=1 skips steps 3 and 4 (quicker
# local runs).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
cd "$repo"
jobs=${GRPC_RDMA_JOBS:-2}
status=0

run_suite() {  # NAME BUILD_DIR
  echo "test: running the $1 suite in $2"
  if ! ctest --test-dir "$2" --output-on-failure -j "$jobs" --timeout 900; then
    status=1
  fi
}

GRPC_RDMA_BUILD_DIR="$repo/build" scripts/setup.sh
run_suite default "$repo/build"

echo "test: the library-only build and its Debian package"
mkdir -p "$repo/build-deb"
# (Outputs captured first: grep -q closing a pipe early fails it under pipefail.)
if GRPC_RDMA_PACKAGE_DIR="$repo/build-deb" scripts/package.sh >"$repo/build-deb/package.log" 2>&1 &&
   deb=$(ls "$repo"/build-deb/grpc-rdma_*.deb) &&
   contents=$(dpkg-deb --contents "$deb") && depends=$(dpkg-deb --field "$deb" Depends) &&
   grep -q '/libgrpc_rdma\.so\.[0-9.]*$' <<<"$contents" &&
   grep -q 'libgrpc[0-9]* (= ' <<<"$depends"; then
  echo "test: package: $deb ($(grep -o 'libgrpc[0-9]* (= [^)]*)' <<<"$depends"))"
else
  echo "test: package: FAILED (scripts/package.sh; its log, build-deb/package.log:)"
  tail -n 30 "$repo/build-deb/package.log"
  status=1
fi

if [[ "${GRPC_RDMA_SKIP_SANITIZERS:-0}" != 1 ]]; then
  GRPC_RDMA_BUILD_DIR="$repo/build-asan" \
    GRPC_RDMA_CMAKE_ARGS="-DGRPC_RDMA_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug" \
    scripts/setup.sh
  run_suite "ASan+UBSan" "$repo/build-asan"
  echo "test: running the ThreadSanitizer suite in $repo/build-tsan"
  if ! scripts/tsan.sh "$repo/build-tsan"; then
    status=1
  fi
fi

if [[ $status -eq 0 ]]; then
  echo "test: all suites passed"
else
  echo "test: FAILED (see above)"
fi
exit $status
