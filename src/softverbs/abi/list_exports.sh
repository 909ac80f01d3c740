#!/usr/bin/env bash
# list_exports.sh - list the versioned symbols a shared library defines.
#
# Usage: list_exports.sh [--all] LIB.so
#
# Prints one line per exported (defined, global/weak) symbol of LIB.so:
#     NAME <TAB> VERSION <TAB> TYPE <TAB> SIZE <TAB> DEFAULT|COMPAT
#   TYPE    FUNC, IFUNC, OBJECT, TLS, COMMON or NOTYPE (as readelf reports it)
#   SIZE    symbol size in bytes (decimal)
#   DEFAULT the symbol is NAME@@VERSION (what new links bind to)
#   COMPAT  the symbol is NAME@VERSION (old ABI alias); only shown with --all
# Sorted by NAME. The absolute symbols that just name a version node are
# skipped, and so are unversioned exports (the libraries this is meant for,
# rdma-core's libibverbs/librdmacm/libmlx5/libefa, have none).
# Used by gen_version_map.sh, gen_trap_stubs.sh and build_provider_stub.sh.
# Needs binutils' readelf.
set -euo pipefail

all=0
if [[ ${1-} == --all ]]; then all=1; shift; fi
if [[ $# -ne 1 ]]; then
    echo "usage: $0 [--all] LIB.so" >&2
    exit 2
fi
lib=$1
[[ -r $lib ]] || { echo "$0: cannot read $lib" >&2; exit 1; }

LC_ALL=C readelf --dyn-syms -W "$lib" | LC_ALL=C awk -v all="$all" '
    function tonum(s,    n, i, c) {        # readelf prints big sizes as 0x...
        if (s !~ /^0x/) return s + 0
        n = 0
        for (i = 3; i <= length(s); i++) {
            c = index("0123456789abcdef", tolower(substr(s, i, 1))) - 1
            n = n * 16 + c
        }
        return n
    }
    # Num: Value Size Type Bind Vis Ndx Name
    $1 ~ /^[0-9]+:$/ && NF >= 8 {
        if ($7 == "UND" || $7 == "ABS") next
        if ($5 != "GLOBAL" && $5 != "WEAK" && $5 != "UNIQUE") next
        name = $8
        p = index(name, "@")
        if (p == 0) next                       # unversioned
        sym = substr(name, 1, p - 1)
        rest = substr(name, p + 1)
        kind = "COMPAT"
        if (substr(rest, 1, 1) == "@") { kind = "DEFAULT"; rest = substr(rest, 2) }
        sub(/[ \t].*$/, "", rest)
        if (kind == "COMPAT" && !all) next
        type = $4
        if (type == "GNU_IFUNC") type = "IFUNC"
        printf "%s\t%s\t%s\t%d\t%s\n", sym, rest, type, tonum($3), kind
    }' | LC_ALL=C sort -t "$(printf '\t')" -k1,1 -k2,2
