#!/usr/bin/env bash
# Builds the Debian package of grpc-rdma on a Debian 12 machine, setting it
# up first (packages, gRPC source; scripts/setup.sh), as a library-only
# build (no tests, benchmarks or softverbs) installed under /usr:
#
#   scripts/package.sh          ->  build-deb/grpc-rdma_<version>_<arch>.deb
#   apt-get install ./build-deb/grpc-rdma_*.deb
#
# The package holds libgrpc_rdma.so, its headers, the CMake package
# (find_package(grpc_rdma)) and grpc_rdma.pc, and depends on the exact
# libgrpc it was built against (the library plugs into gRPC's internals).
#
# Environment: GRPC_RDMA_PACKAGE_DIR  build directory (default <repo>/build-deb)
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
build=${GRPC_RDMA_PACKAGE_DIR:-$repo/build-deb}

GRPC_RDMA_BUILD_DIR="$build" \
  GRPC_RDMA_CMAKE_ARGS="-DCMAKE_INSTALL_PREFIX=/usr -DBUILD_TESTING=OFF \
-DGRPC_RDMA_BUILD_SOFTVERBS=OFF -DGRPC_RDMA_BUILD_BENCHMARKS=OFF -DGRPC_RDMA_BUILD_EXAMPLES=OFF" \
  "$repo/scripts/setup.sh"
rm -f "$build"/grpc-rdma_*.deb
(cd "$build" && cpack -G DEB)
deb=$(ls "$build"/grpc-rdma_*.deb)
echo "package: $deb"
dpkg-deb --field "$deb" Package Version Depends
echo "install it with: apt-get install $deb"
