#!/usr/bin/env bash
# gen_lib.sh REAL_LIB OUT_MAP OUT_STUBS OBJECT...
# Writes the version script and trap stubs for one softverbs library: the
# map mirrors REAL_LIB's version nodes and adds SOFTVERBS_PRIVATE (softverbs'
# own C++ internals, shared between libibverbs.so.1 and librdmacm.so.1); the
# stubs cover every export of REAL_LIB that the objects do not define.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
real=$1 map=$2 stubs=$3
shift 3
implemented=$(mktemp)
trap 'rm -f "$implemented"' EXIT
nm --defined-only -g "$@" | awk 'NF == 3 && $2 ~ /[TDBWR]/ {print $3}' | sort -u > "$implemented"
"$here/abi/gen_trap_stubs.sh" "$real" "$implemented" > "$stubs.tmp"
mv "$stubs.tmp" "$stubs"
{
  "$here/abi/gen_version_map.sh" "$real" | sed '/^  local: \*;$/d'
  printf 'SOFTVERBS_PRIVATE_1 {\n  global:\n    extern "C++" { softverbs::*; };\n    softverbs_trap;\n  local: *;\n};\n'
} > "$map.tmp"
mv "$map.tmp" "$map"
