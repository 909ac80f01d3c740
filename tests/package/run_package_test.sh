#!/usr/bin/env bash
# The installed package, as a user meets it: `cmake --install` of BUILD_DIR
# into an empty prefix, then a small gRPC program (tests/package/consumer)
# built against that prefix twice, with CMake (find_package(grpc_rdma)) and
# with pkg-config (grpc_rdma.pc), each run over softverbs; each must find
# the installed library (not the build tree's) and its call ride RDMA.
# Then the same from the Debian package CPack makes of BUILD_DIR (what
# scripts/package.sh makes), unpacked into an empty directory, whose
# Depends must name the exact libgrpc package installed here.
#
# usage: run_package_test.sh BUILD_DIR [CXXFLAGS]
#   CXXFLAGS: for the consumer, e.g. the sanitizers a sanitized build needs
set -u
build=${1:?usage: run_package_test.sh BUILD_DIR [CXXFLAGS]}
cxxflags=${2:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/grpc_rdma_package.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
passed=0
failed=0
check() {  # NAME COMMAND...: one case
  local name=$1
  shift
  if "$@" >"$tmp/$name.log" 2>&1; then
    echo "ok   $name"
    passed=$((passed + 1))
  else
    echo "FAIL $name:"
    sed 's/^/     /' "$tmp/$name.log"
    failed=$((failed + 1))
  fi
}
finish() {
  echo "$passed passed, $failed failed"
  [[ $failed -eq 0 ]]
  exit
}

consumers() {  # PREFIX LABEL: every check of an installed tree
  prefix=$1
  local label=$2
  libdir=$(dirname "$(find "$prefix" -name 'libgrpc_rdma.so' | head -1)")
  check "$label-files" installed_files
  check "$label-grpc_rdma_info" env SOFTVERBS_DEVICES=mlx5_0:127.0.0.1 \
    "$build/softverbs/softverbs-run" "$prefix/bin/grpc_rdma_info"
  check "$label-cmake-consumer" with_cmake
  check "$label-pkg-config-consumer" with_pkg_config
}

installed_files() {
  local f
  for f in "$libdir/libgrpc_rdma.so" "$prefix/include/grpc_rdma/grpc_rdma.h" \
           "$prefix/include/grpc_rdma/options.h" "$prefix/include/grpc_rdma/version.h" \
           "$libdir/cmake/grpc_rdma/grpc_rdmaConfig.cmake" \
           "$libdir/cmake/grpc_rdma/grpc_rdmaConfigVersion.cmake" \
           "$libdir/cmake/grpc_rdma/grpc_rdmaTargets.cmake" "$libdir/pkgconfig/grpc_rdma.pc" \
           "$prefix/bin/grpc_rdma_info"; do
    [[ -e $f ]] || { echo "missing: $f"; return 1; }
  done
  # Nothing of the development tree: no softverbs, tests or benchmarks.
  if find "$prefix" -name 'libibverbs*' -o -name '*_test' -o -name '*_bench' | grep -q .; then
    echo "installed more than the library:"; find "$prefix" -type f; return 1
  fi
}
run_consumer() {  # BINARY: runs it over softverbs, checks which library it loaded
  local bin=$1
  ldd "$bin" | grep -q "libgrpc_rdma.so.* => $libdir/" ||
    { echo "does not load the installed library:"; ldd "$bin" | grep grpc_rdma; return 1; }
  SOFTVERBS_DEVICES=mlx5_0:127.0.0.1 "$build/softverbs/softverbs-run" "$bin"
}

with_cmake() {
  rm -rf "$tmp/cmake-build"
  cmake -S "$here/consumer" -B "$tmp/cmake-build" -DCMAKE_PREFIX_PATH="$prefix" \
    "-DCMAKE_CXX_FLAGS=$cxxflags" &&
    cmake --build "$tmp/cmake-build" && run_consumer "$tmp/cmake-build/consumer"
}

with_pkg_config() {
  local flags
  flags=$(PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --cflags --libs grpc_rdma grpc++) ||
    return 1
  echo "pkg-config: $flags"
  rm -rf "$tmp/pc-build"
  mkdir -p "$tmp/pc-build"
  # shellcheck disable=SC2086  # the flags are words
  g++ -std=c++17 $cxxflags -o "$tmp/pc-build/consumer" "$here/consumer/consumer.cc" $flags \
    "-Wl,-rpath,$libdir" && run_consumer "$tmp/pc-build/consumer"
}

check install cmake --install "$build" --prefix "$tmp/prefix"
[[ $failed -eq 0 ]] && consumers "$tmp/prefix" installed

make_deb() {
  (cd "$build" && cpack -G DEB -B "$tmp/deb" >/dev/null) || return 1
  deb=$(ls "$tmp"/deb/grpc-rdma_*.deb) || return 1
  dpkg-deb --field "$deb" Package Version Depends
  # The exact libgrpc package the library loads here.
  local grpc_lib grpc_pkg grpc_ver
  grpc_lib=$(ldd "$build/src/glue/libgrpc_rdma.so" | awk '$1 ~ /^libgrpc\.so/ {print $3}')
  grpc_pkg=$(dpkg-query -S "$(readlink -f "$grpc_lib")" | cut -d: -f1)
  grpc_ver=$(dpkg-query -W -f='${Version}' "$grpc_pkg")
  dpkg-deb --field "$deb" Depends | grep -qF "$grpc_pkg (= $grpc_ver)" ||
    { echo "Depends does not pin $grpc_pkg (= $grpc_ver)"; return 1; }
  dpkg-deb -x "$deb" "$tmp/deb-root"
}
check deb make_deb
[[ $failed -eq 0 ]] && consumers "$tmp/deb-root/usr" deb
finish
