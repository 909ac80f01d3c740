#!/usr/bin/env bash
# Fetch and unpack Debian's source package of the installed gRPC.
#
# grpc-rdma compiles against a few of gRPC's internal headers (iomgr and
# friends) and reuses some of gRPC's own tests; Debian installs neither, so
# this script fetches the source package that the installed libgrpc++-dev
# was built from, with apt, and unpacks it (Debian's patches applied) into a
# cache outside the repository:
#
#   ${GRPC_RDMA_CACHE:-/var/cache/grpc-rdma}/grpc-src-<source version>
#
# apt runs with a private configuration under that cache (its own sources
# list with deb-src lines, its own lists and cache dirs): nothing under
# /etc/apt or /var/lib/apt is changed. The deb-src lines are derived from the
# system's own apt sources, with the same Signed-By keyrings, so the download
# is verified just like any package install.
#
# Progress goes to stderr; the tree's path is the last line on stdout.
# Nothing is downloaded when the tree is already there.
#
# --abseil fetches the source of the installed libabsl-dev instead (the
# same way, into .../abseil-src-<version>), for the ThreadSanitizer build
# (scripts/tsan.sh), which needs abseil compiled with the sanitizer.
#
# Environment:
#   GRPC_RDMA_CACHE          cache root (default /var/cache/grpc-rdma, or
#                            ~/.cache/grpc-rdma when that isn't writable)
#   GRPC_RDMA_GRPC_VERSION   source version to fetch (default: the one the
#                            installed libgrpc++-dev was built from)
#   GRPC_RDMA_APT_SOURCES    a ready deb822 .sources file to use instead of
#                            the one derived from the system's sources
set -euo pipefail

prog=fetch-grpc-source
log() { echo "$prog: $*" >&2; }
die() { echo "$prog: error: $*" >&2; exit 1; }

usage() {
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
  echo "Usage: ${BASH_SOURCE[0]} [--abseil] [-h|--help]"
}
bin_pkg=libgrpc++-dev
src_pkg=grpc
marker=src/core/lib/iomgr/endpoint.h
version_override=${GRPC_RDMA_GRPC_VERSION:-}
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --abseil)
    bin_pkg=libabsl-dev src_pkg=abseil marker=absl/base/config.h version_override=""
    prog=fetch-abseil-source ;;
  "") ;;
  *) usage >&2; exit 2 ;;
esac

# --- which version -----------------------------------------------------------
if [[ -n "$version_override" ]]; then
  src_ver=$version_override
else
  status=$(dpkg-query -W -f='${Status}' "$bin_pkg" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] ||
    die "$bin_pkg is not installed (run scripts/setup.sh, or set GRPC_RDMA_GRPC_VERSION)"
  bin_ver=$(dpkg-query -W -f='${Version}' "$bin_pkg")
  src_pkg=$(dpkg-query -W -f='${source:Package}' "$bin_pkg" 2>/dev/null || echo "$src_pkg")
  src_ver=$(dpkg-query -W -f='${source:Version}' "$bin_pkg" 2>/dev/null || true)
  # A binNMU (rebuild without source change) adds "+bN" to the binary's
  # version only; the source package keeps the version without it.
  [[ -n "$src_ver" ]] || src_ver=$bin_ver
  src_ver=$(printf '%s\n' "$src_ver" | sed -E 's/\+b[0-9]+$//')
  log "installed $bin_pkg $bin_ver, built from source package $src_pkg $src_ver"
fi
[[ "$src_ver" =~ ^([0-9]+:)?[0-9][A-Za-z0-9.+~-]*$ ]] || die "odd version '$src_ver'"
ver_noepoch=${src_ver#*:}

# --- where -------------------------------------------------------------------
if [[ -n "${GRPC_RDMA_CACHE:-}" ]]; then
  cache=$GRPC_RDMA_CACHE
elif mkdir -p /var/cache/grpc-rdma 2>/dev/null && [[ -w /var/cache/grpc-rdma ]]; then
  cache=/var/cache/grpc-rdma
else
  cache=${XDG_CACHE_HOME:-$HOME/.cache}/grpc-rdma
fi
mkdir -p "$cache"
cache=$(cd "$cache" && pwd -P)
tree=$cache/$src_pkg-src-$ver_noepoch

if [[ -f "$tree/$marker" ]]; then
  log "already unpacked: $tree"
  echo "$tree"
  exit 0
fi

# One fetch at a time per cache (two shells running setup at once).
exec 9>"$cache/.fetch.lock"
if command -v flock >/dev/null; then
  flock 9
  if [[ -f "$tree/$marker" ]]; then   # the other one did it meanwhile
    log "already unpacked: $tree"
    echo "$tree"
    exit 0
  fi
fi

for tool in apt-get dpkg-source; do
  command -v "$tool" >/dev/null || die "$tool not found (apt-get install dpkg-dev)"
done

start=$SECONDS

# --- private apt configuration -----------------------------------------------
apt_dir=$cache/apt
src_file=$apt_dir/grpc-rdma-src.sources
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"

# Prints deb822 stanzas of deb-src entries for the system's Debian sources.
# Input files are given as arguments; *.list files are one-line style, the
# rest deb822. Only entries whose suite belongs to this release (its codename,
# codename-updates, codename-security, ...) or is one of Debian's suite
# aliases are kept, so that third-party repositories (which rarely publish
# sources) are left out. Signed-By and the other trust options are copied.
derive_sources() {
  local codename
  # shellcheck disable=SC1091
  codename=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
  local f
  for f in "$@"; do
    [[ -r "$f" ]] || continue
    if [[ "$f" == *.list ]]; then
      # One-line style -> deb822-like records, one per line.
      sed -e 's/#.*$//' "$f" | awk '
        $1 == "deb" || $1 == "deb-src" {
          opts = ""
          line = $0
          sub(/^[ \t]*deb(-src)?[ \t]+/, "", line)
          if (line ~ /^\[/) {
            opts = substr(line, 2, index(line, "]") - 2)
            line = substr(line, index(line, "]") + 1)
          }
          n = split(line, w, /[ \t]+/)
          k = 0
          for (i = 1; i <= n; i++) if (w[i] != "") v[++k] = w[i]
          if (k < 2) next
          comps = ""
          for (i = 3; i <= k; i++) comps = comps (comps == "" ? "" : " ") v[i]
          printf "Types: deb-src\nURIs: %s\nSuites: %s\n", v[1], v[2]
          if (comps != "") printf "Components: %s\n", comps
          m = split(opts, o, /[ \t]+/)
          for (i = 1; i <= m; i++) {
            eq = index(o[i], "=")
            if (!eq) continue
            key = tolower(substr(o[i], 1, eq - 1)); val = substr(o[i], eq + 1)
            if (key == "signed-by") printf "Signed-By: %s\n", val
            else if (key == "trusted") printf "Trusted: %s\n", val
            else if (key == "check-valid-until") printf "Check-Valid-Until: %s\n", val
            else if (key == "check-date") printf "Check-Date: %s\n", val
            else if (key == "allow-insecure") printf "Allow-Insecure: %s\n", val
            else if (key == "allow-weak") printf "Allow-Weak: %s\n", val
          }
          printf "\n"
        }'
    else
      cat "$f"
      printf '\n\n'
    fi
  done | sed -e 's/^[ \t]*$//' | awk -v codename="$codename" '
    function keep_suite(s) {
      if (codename == "") return 1
      if (s == codename || index(s, codename "-") == 1 || index(s, codename "/") == 1) return 1
      return s ~ /^(stable|oldstable|oldoldstable|testing|unstable|sid|experimental)([-\/].*)?$/
    }
    BEGIN { RS = ""; FS = "\n" }
    {
      delete val; delete order; nf = 0; cur = ""
      for (i = 1; i <= NF; i++) {
        line = $i
        if (line ~ /^#/) continue
        if (line ~ /^[ \t]/) {            # continuation of a multi-line field
          if (cur != "") val[cur] = val[cur] "\n" line
          continue
        }
        c = index(line, ":")
        if (!c) continue
        name = substr(line, 1, c - 1); key = tolower(name)
        v = substr(line, c + 1); sub(/^[ \t]+/, "", v); sub(/[ \t]+$/, "", v)
        if (!(key in val)) order[++nf] = key
        val[key] = v; cur = key
        label[key] = name
      }
      if (tolower(val["enabled"]) == "no") next
      if (val["types"] !~ /(^|[ \t])deb(-src)?([ \t]|$)/) next
      if (val["uris"] == "" || val["suites"] == "") next
      n = split(val["suites"], s, /[ \t]+/); suites = ""
      for (i = 1; i <= n; i++) if (s[i] != "" && keep_suite(s[i])) suites = suites (suites == "" ? "" : " ") s[i]
      if (suites == "") next
      id = val["uris"] "|" suites "|" val["components"]
      if (id in seen) next
      seen[id] = 1
      printf "Types: deb-src\nURIs: %s\nSuites: %s\n", val["uris"], suites
      if (val["components"] != "") printf "Components: %s\n", val["components"]
      split("signed-by trusted check-valid-until check-date allow-insecure allow-weak", keys, " ")
      for (j = 1; j in keys; j++)
        if (keys[j] in val) {
          v = val[keys[j]]
          printf "%s:%s%s\n", label[keys[j]], (substr(v, 1, 1) == "\n" ? "" : " "), v
        }
      printf "\n"
    }'
}

if [[ -n "${GRPC_RDMA_APT_SOURCES:-}" ]]; then
  [[ -r "$GRPC_RDMA_APT_SOURCES" ]] || die "cannot read GRPC_RDMA_APT_SOURCES=$GRPC_RDMA_APT_SOURCES"
  cp "$GRPC_RDMA_APT_SOURCES" "$src_file.new"
else
  shopt -s nullglob
  sys_files=(/etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources)
  shopt -u nullglob
  derive_sources "${sys_files[@]}" >"$src_file.new"
fi
grep -q '^Types: deb-src' "$src_file.new" ||
  die "found no Debian apt source to derive deb-src entries from (looked in /etc/apt/sources.list and /etc/apt/sources.list.d/); set GRPC_RDMA_APT_SOURCES to a deb822 .sources file with a deb-src entry"
mv "$src_file.new" "$src_file"
log "private apt sources: $src_file"
sed 's/^/    /' "$src_file" >&2

apt_opts=(
  -o "Dir::Etc::SourceList=$src_file"
  -o "Dir::Etc::SourceParts=/dev/null"
  -o "Dir::State::Lists=$apt_dir/lists"
  -o "Dir::Cache=$apt_dir/cache"
  -o "Acquire::Languages=none"
  -o "APT::Get::List-Cleanup=true"
)

# apt downloads as the unprivileged user _apt when run as root; let it write
# where it must so the download stays sandboxed.
sandbox_dir() {
  if [[ $EUID -eq 0 ]] && id _apt >/dev/null 2>&1; then
    chown _apt:root "$1"
  fi
}
sandbox_dir "$apt_dir/lists/partial"
sandbox_dir "$apt_dir/cache/archives/partial"

log "updating the private source index (apt-get update)"
if ! apt-get -q "${apt_opts[@]}" update >&2; then
  # A source that failed (say, a mirror that is down) need not matter as
  # long as one of the others has the package: the next step tells.
  log "warning: apt-get update reported errors; trying to fetch anyway"
fi

dl_dir=$cache/downloads/${src_pkg}_$ver_noepoch
mkdir -p "$dl_dir"
sandbox_dir "$dl_dir"
log "downloading source package $src_pkg=$src_ver into $dl_dir"
if ! (cd "$dl_dir" && apt-get -q "${apt_opts[@]}" source --download-only "$src_pkg=$src_ver" >&2); then
  rmdir "$dl_dir" 2>/dev/null || true
  die "could not download source package $src_pkg=$src_ver. The archive may have moved on to a newer
  version than the one installed; upgrade it (apt-get install --only-upgrade $bin_pkg)
  and run this again, or set GRPC_RDMA_GRPC_VERSION to a version that apt can still fetch."
fi

dsc=$dl_dir/${src_pkg}_$ver_noepoch.dsc
[[ -f "$dsc" ]] || die "expected $dsc after the download; it is not there"

log "unpacking $(basename "$dsc") (dpkg-source -x)"
# apt has checked the files' hashes against the archive's signed index; the
# .dsc's own signature can only be checked with debian-keyring installed,
# without it dpkg-source warns and goes on.
tmp=$cache/.$src_pkg-src-$ver_noepoch.tmp.$$
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT
(cd "$dl_dir" && dpkg-source --no-copy -x "$dsc" "$tmp" >&2)
[[ -f "$tmp/$marker" ]] || die "the unpacked tree has no $marker: not a $src_pkg source tree?"
rm -rf "$tree"
mv "$tmp" "$tree"
trap - EXIT

log "unpacked into $tree in $((SECONDS - start)) s ($(du -sh "$tree" | cut -f1))"
echo "$tree"
