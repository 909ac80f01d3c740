#!/usr/bin/env bash
# run_pyverbs.sh - rdma-core's own test suite (Debian's python3-pyverbs,
# /usr/share/doc/rdma-core/tests) over softverbs, judged by
# pyverbs_runner.py: no failure, no error, skips only for what softverbs
# does not emulate.
#
# usage: run_pyverbs.sh --launcher PATH/softverbs-run --wire shm|tcp
#
# The RDMA CM tests find the device's IP address the way they do on real
# hardware, through /sys/class/infiniband/DEV/device/net/IFACE. softverbs'
# devices have no sysfs entry, so the suite runs in a private mount
# namespace (unshare -m) where /sys/class is a tmpfs holding links to the
# real classes plus that one path (mlx5_0 -> lo, 127.0.0.1): the host's
# mounts are untouched. Needs root. Its RDMA CM tests listen on a fixed
# port (7471 on 127.0.0.1): two runs at once collide (CTest keeps them
# apart with a resource lock).
set -u

LAUNCHER=""
WIRE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --launcher) LAUNCHER=$2; shift 2 ;;
    --wire) WIRE=$2; shift 2 ;;
    *) echo "usage: $0 --launcher PATH/softverbs-run --wire shm|tcp" >&2; exit 2 ;;
  esac
done
[ -x "$LAUNCHER" ] && { [ "$WIRE" = shm ] || [ "$WIRE" = tcp ]; } ||
  { echo "usage: $0 --launcher PATH/softverbs-run --wire shm|tcp" >&2; exit 2; }

LAUNCHER=$(realpath "$LAUNCHER")
SUITE=/usr/share/doc/rdma-core/tests
PY=/usr/bin/python3  # Debian's: the one python3-pyverbs is built for
if [ ! -e "$SUITE/run_tests.py" ]; then
  echo "FAIL: $SUITE not found: install python3-pyverbs (scripts/setup.sh does)"
  exit 1
fi
if ! "$PY" -c 'import pyverbs' 2>/dev/null; then
  echo "FAIL: $PY cannot import pyverbs: install python3-pyverbs (scripts/setup.sh does)"
  exit 1
fi
if [ "$(id -u)" != 0 ]; then
  echo "FAIL: needs root (a private mount namespace for the CM tests' sysfs path)"
  exit 1
fi

HERE=$(cd "$(dirname "$0")" && pwd)
TMP=$(mktemp -d /tmp/pyverbs.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
cp -r "$SUITE" "$TMP/tests"
find "$TMP/tests" -name '*.gz' -exec gunzip -f {} +

export SOFTVERBS_DEVICES=mlx5_0:127.0.0.1
[ "$WIRE" = tcp ] && export SOFTVERBS_SHM=0
cd "$TMP"
timeout 900 unshare -m --propagation private bash -c '
  set -e
  orig=$(mktemp -d "$1/class.XXXXXX")
  mount --bind /sys/class "$orig"
  mount -t tmpfs grpc-rdma-pyverbs /sys/class
  for e in "$orig"/*; do ln -s "$e" "/sys/class/${e##*/}"; done
  mkdir -p /sys/class/infiniband/mlx5_0/device/net/lo
  shift
  exec "$@"
' unshare-sys "$TMP" "$LAUNCHER" "$PY" "$HERE/pyverbs_runner.py" "$TMP/tests"
rc=$?
[ $rc -eq 124 ] && echo "FAIL: the suite did not finish within 900 s"
exit $rc
