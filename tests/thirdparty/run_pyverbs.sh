#!/usr/bin/env bash
# run_pyverbs.sh - rdma-core's own test suite (Debian's python3-pyverbs,
# /usr/share/doc/rdma-core/tests) over softverbs, judged by
# pyverbs_runner.py: no failure, no error, skips only for what softverbs
# does not emulate.
#
# usage: run_pyverbs.sh --launcher PATH/softverbs-run --wire shm|tcp [--two-hosts]
#
# The RDMA CM tests find the device's IP address the way they do on real
# hardware, through /sys/class/infiniband/DEV/device/net/IFACE. softverbs'
# devices have no sysfs entry, so the suite runs in a private mount
# namespace (unshare -m) where /sys/class is a tmpfs holding links to the
# real classes plus that one path (mlx5_0 -> lo, 127.0.0.1): the host's
# mounts are untouched. Needs root. Its RDMA CM tests listen on a fixed
# port (7471 on 127.0.0.1): two runs at once collide (CTest keeps them
# apart with a resource lock).
#
# --two-hosts runs only the RDMA CM tests, between two network namespaces
# joined by a veth pair, as two hosts: the suite and its passive player in
# one (device mlx5_0 on its address), the active player in the other
# (device mlx5_1 on that one's address; pyverbs_runner.py --two-hosts).
set -u

USAGE="usage: $0 --launcher PATH/softverbs-run --wire shm|tcp [--two-hosts]"
LAUNCHER=""
WIRE=""
TWO_HOSTS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --launcher) LAUNCHER=${2:-}; shift 2 || shift ;;
    --wire) WIRE=${2:-}; shift 2 || shift ;;
    --two-hosts) TWO_HOSTS=1; shift ;;
    *) echo "$USAGE" >&2; exit 2 ;;
  esac
done
[ -x "$LAUNCHER" ] && { [ "$WIRE" = shm ] || [ "$WIRE" = tcp ]; } ||
  { echo "$USAGE" >&2; exit 2; }

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
NS_A="svpv-$$-a"
NS_B="svpv-$$-b"
VETH_A="svpva$$"
VETH_B="svpvb$$"
ADDR_A="10.211.$(($$ % 250)).1"
ADDR_B="10.211.$(($$ % 250)).2"
cleanup() {
  if [ "$TWO_HOSTS" = 1 ]; then
    ip netns del "$NS_A" 2>/dev/null
    ip netns del "$NS_B" 2>/dev/null
    ip link del "$VETH_A" 2>/dev/null  # left in this namespace if set-up failed half way
  fi
  rm -rf "$TMP"
}
trap cleanup EXIT
cp -r "$SUITE" "$TMP/tests"
find "$TMP/tests" -name '*.gz' -exec gunzip -f {} +

[ "$WIRE" = tcp ] && export SOFTVERBS_SHM=0
NETDEV=lo
RUNNER=("$HERE/pyverbs_runner.py")
IN_NS=()
if [ "$TWO_HOSTS" = 1 ]; then
  if ! { ip netns add "$NS_A" && ip netns add "$NS_B" &&
         ip link add "$VETH_A" type veth peer name "$VETH_B" &&
         ip link set "$VETH_A" netns "$NS_A" && ip link set "$VETH_B" netns "$NS_B" &&
         ip -n "$NS_A" addr add "$ADDR_A/24" dev "$VETH_A" &&
         ip -n "$NS_B" addr add "$ADDR_B/24" dev "$VETH_B" &&
         ip -n "$NS_A" link set lo up && ip -n "$NS_B" link set lo up &&
         ip -n "$NS_A" link set "$VETH_A" up && ip -n "$NS_B" link set "$VETH_B" up; } \
       >"$TMP/netns.log" 2>&1; then
    echo "FAIL: network namespace setup failed: $(tail -n 1 "$TMP/netns.log")"
    exit 1
  fi
  for _ in $(seq 50); do
    ip -n "$NS_A" link show "$VETH_A" | grep -q 'state UP' &&
      ip -n "$NS_B" link show "$VETH_B" | grep -q 'state UP' && break
    sleep 0.1
  done
  export SOFTVERBS_DEVICES="mlx5_0:$ADDR_A,mlx5_1:$ADDR_B"
  NETDEV=$VETH_A
  RUNNER+=(--two-hosts "/run/netns/$NS_B" "$ADDR_B")
  IN_NS=(ip netns exec "$NS_A")
else
  export SOFTVERBS_DEVICES=mlx5_0:127.0.0.1
fi
cd "$TMP"
# `ip netns exec` gives the command its own mount namespace with the
# namespace's /sys; the tmpfs goes over that one.
timeout 900 "${IN_NS[@]}" unshare -m --propagation private bash -c '
  set -e
  orig=$(mktemp -d "$1/class.XXXXXX")
  mount --bind /sys/class "$orig"
  mount -t tmpfs grpc-rdma-pyverbs /sys/class
  for e in "$orig"/*; do ln -s "$e" "/sys/class/${e##*/}"; done
  mkdir -p "/sys/class/infiniband/mlx5_0/device/net/$2"
  shift 2
  exec "$@"
' unshare-sys "$TMP" "$NETDEV" "$LAUNCHER" "$PY" "${RUNNER[@]}" "$TMP/tests"
rc=$?
[ $rc -eq 124 ] && echo "FAIL: the suite did not finish within 900 s"
exit $rc
