#!/bin/sh
# softverbs-run is relocatable: copied with its lib/ directory anywhere, it
# still runs a program over softverbs (ibv_devices lists the device); copied
# without it, it refuses with a message instead of letting the program load
# the system's libibverbs and find no device.
#
# usage: softverbs_run_test.sh BUILD_DIR
set -u
build=${1:?usage: softverbs_run_test.sh BUILD_DIR}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/softverbs_run.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
failed=0

mkdir -p "$tmp/moved"
cp "$build/softverbs/softverbs-run" "$tmp/moved/"
cp -a "$build/softverbs/lib" "$tmp/moved/"
out=$(SOFTVERBS_DEVICES=mlx5_0:127.0.0.1 "$tmp/moved/softverbs-run" ibv_devices 2>&1)
if echo "$out" | grep -q "mlx5_0"; then
  echo "ok   moved with lib/: ibv_devices lists mlx5_0"
else
  echo "FAIL moved with lib/: ibv_devices said: $out"
  failed=1
fi

mkdir -p "$tmp/alone"
cp "$build/softverbs/softverbs-run" "$tmp/alone/"
ln -s "$tmp/moved/softverbs-run" "$tmp/alone/link"
out=$(SOFTVERBS_DEVICES=mlx5_0:127.0.0.1 "$tmp/alone/softverbs-run" ibv_devices 2>&1)
rc=$?
if [ $rc -eq 127 ] && echo "$out" | grep -q "libibverbs.so.1 is missing"; then
  echo "ok   alone: refused (127): $out"
else
  echo "FAIL alone: exit $rc, said: $out"
  failed=1
fi
# Through a symbolic link: the libraries are beside the script it points to.
out=$(SOFTVERBS_DEVICES=mlx5_0:127.0.0.1 "$tmp/alone/link" ibv_devices 2>&1)
if echo "$out" | grep -q "mlx5_0"; then
  echo "ok   through a link to the moved one"
else
  echo "FAIL through a link: $out"
  failed=1
fi
exit $failed
