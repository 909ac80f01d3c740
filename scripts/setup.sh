#!/usr/bin/env bash
# Set up a Debian 12 machine for grpc-rdma and build it. Safe to run again:
# every step skips what is already done.
#
#   a. installs the Debian packages the project needs (only missing ones)
#   b. fetches Debian's source package of the installed gRPC into a cache
#      outside the repo (scripts/fetch-grpc-source.sh)
#   c. configures and builds the project with CMake
#
# Usage: scripts/setup.sh [--no-build]
#   --no-build   stop after step b
#
# Environment:
#   GRPC_RDMA_BUILD_DIR    build directory (default <repo>/build)
#   GRPC_RDMA_CMAKE_ARGS   extra arguments for the CMake configure step,
#                          split at spaces (e.g. "-DGRPC_RDMA_SANITIZE=ON")
#   GRPC_RDMA_JOBS         parallel build jobs (default 2)
#   GRPC_RDMA_CACHE        where the gRPC source goes (see fetch-grpc-source.sh)
set -euo pipefail

log() { echo "setup: $*"; }
die() { echo "setup: error: $*" >&2; exit 1; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)

build=1
for arg in "$@"; do
  case "$arg" in
    --no-build) build=0 ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) die "unknown argument '$arg' (try --help)" ;;
  esac
done

as_root() {
  if [[ $EUID -eq 0 ]]; then
    "$@"
  elif command -v sudo >/dev/null; then
    sudo "$@"
  else
    die "need root to run: $*"
  fi
}

# --- a. Debian packages ------------------------------------------------------
packages=(
  # toolchain
  build-essential cmake pkg-config dpkg-dev
  # gRPC 1.51 and protobuf, abseil, OpenSSL
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev
  protobuf-compiler libabsl-dev libssl-dev
  # RDMA verbs and rdma-cm, their tools, perftest
  libibverbs-dev librdmacm-dev ibverbs-utils rdmacm-utils perftest
  # rdma-core's own test suite (pyverbs), run over softverbs
  python3-pyverbs
  # tests and benchmarks
  googletest libgtest-dev libgmock-dev libbenchmark-dev
  # fuzzers (tests/fuzz): clang and its libFuzzer runtime
  clang libclang-rt-14-dev
  # scripts: network namespaces, process tools, plots, test certificates
  iproute2 procps python3 python3-matplotlib openssl
)

missing=()
for pkg in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done
if ((${#missing[@]})); then
  log "installing ${#missing[@]} missing Debian package(s): ${missing[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get -q update
  as_root env DEBIAN_FRONTEND=noninteractive apt-get -q install -y \
    --no-install-recommends "${missing[@]}" </dev/null
else
  log "all ${#packages[@]} Debian packages already installed"
fi

# --- b. gRPC's source --------------------------------------------------------
log "gRPC source tree (scripts/fetch-grpc-source.sh)"
grpc_src=$("$repo/scripts/fetch-grpc-source.sh" | tail -n 1)
[[ -n "$grpc_src" && -f "$grpc_src/src/core/lib/iomgr/endpoint.h" ]] ||
  die "fetch-grpc-source.sh gave no usable tree ('$grpc_src')"
log "gRPC source tree: $grpc_src"

if ((!build)); then
  log "done (--no-build)"
  exit 0
fi

# --- c. configure and build --------------------------------------------------
build_dir=${GRPC_RDMA_BUILD_DIR:-$repo/build}
jobs=${GRPC_RDMA_JOBS:-2}
extra=()
if [[ -n "${GRPC_RDMA_CMAKE_ARGS:-}" ]]; then
  read -r -a extra <<<"$GRPC_RDMA_CMAKE_ARGS"
fi

log "configuring in $build_dir"
cmake -S "$repo" -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  "-DGRPC_RDMA_GRPC_SOURCE_DIR=$grpc_src" ${extra[@]+"${extra[@]}"}
log "building ($jobs jobs)"
cmake --build "$build_dir" -j "$jobs"
log "done: built in $build_dir"
