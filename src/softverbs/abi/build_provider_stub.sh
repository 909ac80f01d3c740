#!/usr/bin/env bash
# build_provider_stub.sh - build a stand-in for an rdma-core provider library
# (e.g. libmlx5.so.1, libefa.so.1) in which every export aborts when called.
#
# Usage: build_provider_stub.sh LIB.so OUTDIR
#
#   LIB.so  the installed library to mirror (/usr/lib/x86_64-linux-gnu/libmlx5.so.1)
#   OUTDIR  where OUTDIR/<SONAME of LIB> is written (created if missing)
#   env CC (default cc), CFLAGS (default -O2), KEEP=1 keeps the generated
#   .map and .c next to the library as <SONAME>.map / <SONAME>.stubs.c.
#
# The stand-in has LIB's SONAME, version nodes and default-versioned exports
# (from gen_version_map.sh and gen_trap_stubs.sh --self-contained with nothing
# implemented) and needs only libc: no NEEDED on libibverbs. Programs such as
# perftest link libmlx5/libefa directly and never call them without the real
# hardware; the real ones cannot load against softverbs' libibverbs.so.1
# (they import IBVERBS_PRIVATE_34 symbols), so put the stand-ins in the same
# directory as softverbs' libibverbs.so.1 / librdmacm.so.1.
# The result is checked: same SONAME, no libibverbs dependency, same
# default-versioned exports (name, version, kind; size for data) as LIB.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ $# -ne 2 ]]; then
    echo "usage: $0 LIB.so OUTDIR" >&2
    exit 2
fi
lib=$1
outdir=$2
[[ -r $lib ]] || { echo "$0: cannot read $lib" >&2; exit 1; }

soname=$(LC_ALL=C readelf -d -W "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p')
[[ -n $soname ]] || { echo "$0: $lib has no SONAME" >&2; exit 1; }

mkdir -p "$outdir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$here/gen_version_map.sh" "$lib" > "$work/$soname.map"
# Exports that answer instead of trapping (capability checks): defined in
# provider_answers/<name>.c, one definition per line start.
answers="$here/provider_answers/${soname%%.so*}.c"
implemented=/dev/null
extra=()
if [[ -f $answers ]]; then
    sed -n 's/^[A-Za-z_][A-Za-z0-9_ ]*[ *]\([A-Za-z_][A-Za-z0-9_]*\)(.*/\1/p' "$answers" \
        > "$work/implemented.txt"
    implemented=$work/implemented.txt
    extra=("$answers")
fi
"$here/gen_trap_stubs.sh" --self-contained "$lib" "$implemented" > "$work/$soname.stubs.c"

# shellcheck disable=SC2086  # CFLAGS is a list of words
${CC:-cc} ${CFLAGS:--O2} -fPIC -shared -x c "$work/$soname.stubs.c" "${extra[@]}" \
    -Wl,-soname,"$soname" -Wl,--version-script="$work/$soname.map" -Wl,-z,defs \
    -o "$work/$soname"

# Checks.
if LC_ALL=C readelf -d -W "$work/$soname" | grep -q 'NEEDED.*\[libibverbs\.so'; then
    echo "$0: $soname unexpectedly depends on libibverbs" >&2
    exit 1
fi
sig() {   # name, version, kind (function or data), size for data
    "$here/list_exports.sh" "$1" | awk -F'\t' '{
        data = ($3 ~ /^(OBJECT|COMMON|TLS)$/)
        print $1 "@@" $2 " " (data ? "data " $4 : "func") }'
}
if ! diff <(sig "$lib") <(sig "$work/$soname") > "$work/diff"; then
    echo "$0: exports of the stand-in differ from $lib (< real, > stand-in):" >&2
    cat "$work/diff" >&2
    exit 1
fi
nodes() { LC_ALL=C readelf -V -W "$1" | sed -n '/^Version definition/,/^Version needs/p' |
          grep -oE '(Name|Parent [0-9]+): [^ ]+' ; }
if ! diff <(nodes "$lib") <(nodes "$work/$soname") > "$work/diff"; then
    echo "$0: version definitions of the stand-in differ from $lib:" >&2
    cat "$work/diff" >&2
    exit 1
fi

mv -f "$work/$soname" "$outdir/$soname"
if [[ ${KEEP:-0} == 1 ]]; then
    mv -f "$work/$soname.map" "$work/$soname.stubs.c" "$outdir/"
fi
echo "$0: built $outdir/$soname ($(sig "$lib" | wc -l) trapping exports)" >&2
