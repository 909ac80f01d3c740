#!/usr/bin/env bash
# list_needed_symbols.sh - list the RDMA library symbols that binaries import.
#
# Usage: list_needed_symbols.sh [--by-lib | --names] [--libs L1,L2,...] BINARY...
#
#   BINARY   ELF executables or shared libraries; a bare name that is not a
#            file is looked up in PATH (e.g. "ib_write_lat")
#   (default)  print NAME@VERSION, sorted, unique
#   --by-lib   print "SONAME NAME@VERSION", grouped by library
#   --names    print only NAME (e.g. to compare with an IMPLEMENTED.txt)
#   --libs     sonames to report (default: libibverbs.so.1,librdmacm.so.1,
#              libmlx5.so.1,libefa.so.1)
#
# An import is attributed to a library through the binary's version-needs
# ("required from SONAME") table, so only versioned references are seen;
# unversioned ones (binary linked against an unversioned library) are reported
# as a warning on stderr if they look like ibv_/rdma_/mlx5dv_/efadv_ names.
# Needs binutils' objdump.
set -euo pipefail

mode=plain
libs=libibverbs.so.1,librdmacm.so.1,libmlx5.so.1,libefa.so.1
bins=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --by-lib) mode=bylib ;;
        --names) mode=names ;;
        --libs) libs=$2; shift ;;
        --libs=*) libs=${1#--libs=} ;;
        -h|--help) sed -n '2,/^set -e/p' "$0" | sed -e '/^set -e/d' -e 's/^# \{0,1\}//'; exit 0 ;;
        -?*) echo "$0: unknown option $1" >&2; exit 2 ;;
        *) bins+=("$1") ;;
    esac
    shift
done
if [[ ${#bins[@]} -eq 0 ]]; then
    echo "usage: $0 [--by-lib | --names] [--libs L1,L2,...] BINARY..." >&2
    exit 2
fi

status=0
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
for b in "${bins[@]}"; do
    f=$b
    if [[ ! -e $f && $f != */* ]]; then f=$(command -v -- "$f" || true); fi
    if [[ -z $f || ! -r $f ]]; then
        echo "$0: $b: not found" >&2; status=1; continue
    fi
    if ! LC_ALL=C objdump -p "$f" > /dev/null 2>&1; then
        echo "$0: $b: not an ELF file objdump can read" >&2; status=1; continue
    fi
    # "VERSION SONAME" for every version required from a listed library.
    vermap=$(LC_ALL=C objdump -p "$f" | LC_ALL=C awk -v libs="$libs" '
        BEGIN { n = split(libs, l, ","); for (i = 1; i <= n; i++) want[l[i]] = 1 }
        /^Version References:/ { in_ref = 1; next }
        in_ref && /^[^ \t]/ { in_ref = 0 }
        !in_ref { next }
        /required from/ { lib = $3; sub(/:$/, "", lib); next }
        NF >= 4 && (lib in want) { print $4, lib }')
    # Undefined dynamic symbols: "... *UND* SIZE [(VERSION)|VERSION|Base] NAME"
    LC_ALL=C objdump -T "$f" | LC_ALL=C awk -v vermap="$vermap" -v bin="$b" -v me="$0" '
        BEGIN {
            n = split(vermap, l, "\n")
            for (i = 1; i <= n; i++) { split(l[i], p, " "); if (p[1] != "") lib[p[1]] = p[2] }
        }
        /\*UND\*/ {
            name = $NF; ver = $(NF - 1)
            gsub(/[()]/, "", ver)
            if (ver in lib) { print lib[ver] "\t" name "@" ver; next }
            if ((ver == "Base" || ver ~ /^[0-9a-f]+$/) &&
                name ~ /^(ibv_|_ibv_|rdma_|mlx5dv_|efadv_)/)
                printf "%s: warning: %s imports %s unversioned; not attributed\n",
                       me, bin, name > "/dev/stderr"
        }' >> "$tmp"
done
rows=$(LC_ALL=C sort -u "$tmp")

case $mode in
    plain) [[ -n $rows ]] && cut -f2 <<<"$rows" | LC_ALL=C sort -u ;;
    names) [[ -n $rows ]] && cut -f2 <<<"$rows" | sed 's/@.*//' | LC_ALL=C sort -u ;;
    bylib) [[ -n $rows ]] && tr '\t' ' ' <<<"$rows" ;;
esac
exit $status
