#!/usr/bin/env bash
# grpc_rdma_info over softverbs: what it reports for good and bad settings,
# with no device, and what --probe finds at a grpc-rdma server and at a
# server without the plugin.
#
# usage: grpc_rdma_info_test.sh BUILD_DIR
set -u
build=${1:?usage: grpc_rdma_info_test.sh BUILD_DIR}
info=$build/src/tools/grpc_rdma_info
run=$build/softverbs/softverbs-run
tool=$build/tests/grpc/echo_tool
tmp=$(mktemp -d "${TMPDIR:-/tmp}/grpc_rdma_info.XXXXXX")
export SOFTVERBS_DEVICES=mlx5_0:127.0.0.1
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
passed=0
failed=0
# case NAME WANT_EXIT WANT_TEXT... -- COMMAND...
case_() {
  local name=$1 want=$2
  shift 2
  local texts=()
  while [[ $1 != -- ]]; do texts+=("$1"); shift; done
  shift
  local out rc ok=1
  out=$("$@" 2>&1)
  rc=$?
  [[ $rc -eq $want ]] || ok=0
  for t in "${texts[@]}"; do grep -qF -- "$t" <<<"$out" || ok=0; done
  if [[ $ok -eq 1 ]]; then
    echo "ok   $name"
    passed=$((passed + 1))
  else
    echo "FAIL $name (exit $rc, wanted $want; wanted: ${texts[*]}):"
    sed 's/^/     /' <<<"$out"
    failed=$((failed + 1))
  fi
}

case_ defaults 0 "grpc-rdma 0.1.0 (built for gRPC" "settings: enabled=true device=mlx5_0 (default)" \
  "RDMA devices: 1" "mlx5_0 port 1: ACTIVE, InfiniBand, MTU 4096, IPv4 127.0.0.1" \
  "device: whichever RDMA CM resolves" "stats: not written" -- "$run" "$info"
case_ named-device 0 "<- TF_RDMA_DEV_NAME" "device: mlx5_0 only (TF_RDMA_DEV_NAME)" -- \
  env TF_RDMA_DEV_NAME=mlx5_0 "$run" "$info"
case_ stats-settings 0 "stats: to stderr every 30 s (TF_RDMA_STATS_INTERVAL_S) and at exit" -- \
  env TF_RDMA_STATS_INTERVAL_S=30 "$run" "$info"
case_ stats-bad-interval 1 "TF_RDMA_STATS_INTERVAL_S='1h'" -- \
  env TF_RDMA_STATS_INTERVAL_S=1h "$run" "$info"
case_ roce-settings 0 "port: 1 only (TF_RDMA_PORT)" "GID: index 0 only (TF_RDMA_GID_INDEX)" \
  "type of service: 96 (TF_RDMA_TOS)" "port=1 gid_index=0 tos=96" -- \
  env TF_RDMA_PORT=1 TF_RDMA_GID_INDEX=0 TF_RDMA_TOS=96 "$run" "$info"
case_ absent-port 1 "RDMA is off, gRPC would use TCP: TF_RDMA_PORT=3: no such port" \
  "mlx5_0 has 1 port" -- env TF_RDMA_PORT=3 "$run" "$info"
case_ bad-setting 1 "settings: not valid, so gRPC would use TCP" "TF_RDMA_CHUNK_SIZE='banana'" -- \
  env TF_RDMA_CHUNK_SIZE=banana "$run" "$info"
case_ absent-device 1 "RDMA is off, gRPC would use TCP: TF_RDMA_DEV_NAME=mlx5_9: no such RDMA device" \
  -- env TF_RDMA_DEV_NAME=mlx5_9 "$run" "$info"
case_ no-softverbs 1 "RDMA devices: 0" "RDMA is off, gRPC would use TCP" -- "$info"
case_ bad-usage 3 "unknown argument '--bogus'" -- "$run" "$info" --bogus
# TF_RDMA_MALLOC_TUNE: said either way (glibc's malloc tuned, or, in a
# sanitizer's build, not glibc's), and never over the process's own choice.
case_ malloc-default 0 "malloc_tune=true" "malloc: " -- "$run" "$info"
case_ malloc-own 0 "malloc: left as the process set it" -- \
  env GLIBC_TUNABLES=glibc.malloc.trim_threshold=0 "$run" "$info"
case_ malloc-off 0 "malloc_tune=false" -- env TF_RDMA_MALLOC_TUNE=false "$run" "$info"
case_ malloc-bad 1 "TF_RDMA_MALLOC_TUNE='sometimes'" -- env TF_RDMA_MALLOC_TUNE=sometimes "$run" "$info"

# serve NAME PLUGIN(0|1): echo_tool serve on 127.0.0.1, its port in PORT.
serve() {
  local name=$1 plugin=$2 pre=()
  [[ $plugin == 1 ]] && pre=(--preload "$build/src/glue/libgrpc_rdma.so")
  mkfifo "$tmp/$name.in"
  "$run" "${pre[@]}" "$tool" serve 127.0.0.1:0 <"$tmp/$name.in" >"$tmp/$name.out" 2>&1 &
  pids+=($!)
  exec {fd}>"$tmp/$name.in"
  PORT=""
  for _ in $(seq 1 100); do
    PORT=$(awk '/^port /{print $2}' "$tmp/$name.out")
    [[ -n $PORT ]] && return 0
    sleep 0.1
  done
  echo "FAIL $name: the server did not start: $(cat "$tmp/$name.out")"
  failed=$((failed + 1))
  return 1
}
if serve rdma 1; then
  case_ probe-rdma 0 "probe 127.0.0.1:$PORT: a grpc-rdma server answers over RDMA" -- \
    "$run" "$info" --probe "127.0.0.1:$PORT"
fi
if serve plain 0; then
  case_ probe-plain 2 "probe 127.0.0.1:$PORT: no RDMA connection" \
    "a gRPC client here would use TCP for it" -- "$run" "$info" --probe "127.0.0.1:$PORT"
fi
case_ probe-not-ipv4 2 "not an IPv4 HOST:PORT" -- "$run" "$info" --probe "[::1]:50051"
echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
