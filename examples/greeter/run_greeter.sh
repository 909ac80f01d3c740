#!/usr/bin/env bash
# Runs the unmodified greeter server and client over softverbs with
# grpc-rdma preloaded, and shows that the call rode RDMA: the reply names
# the client's address as the server saw it (rdma:...), and the client's
# stats (TF_RDMA_STATS) count one RDMA connection and no TCP one.
#
# usage: run_greeter.sh BUILD_DIR
set -u
build=${1:?usage: run_greeter.sh BUILD_DIR}
run="$build/softverbs/softverbs-run --preload $build/src/glue/libgrpc_rdma.so"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/greeter.XXXXXX")
export SOFTVERBS_DEVICES=mlx5_0:127.0.0.1
cleanup() { [ -n "${spid:-}" ] && kill "$spid" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT

$run "$build/examples/greeter/greeter_server" 127.0.0.1:0 >"$tmp/server.out" 2>&1 &
spid=$!
port=""
for _ in $(seq 1 100); do
  port=$(awk '/listening on port/{print $5}' "$tmp/server.out")
  [ -n "$port" ] && break
  sleep 0.1
done
if [ -z "$port" ]; then
  echo "greeter server did not start:"; cat "$tmp/server.out"
  echo "0 passed, 1 failed"; exit 1
fi
# One call and out: by default (TF_RDMA_TCP_FIRST on) it would ride TCP
# while RDMA CM connects beside it, and the client would exit before its
# connection moved. Waiting for RDMA CM shows the call riding RDMA.
TF_RDMA_TCP_FIRST=0 TF_RDMA_STATS="$tmp/client.stats" $run "$build/examples/greeter/greeter_client" \
  "127.0.0.1:$port" RDMA >"$tmp/client.out" 2>&1
rc=$?
echo "client: $(cat "$tmp/client.out")"
echo "client stats: $(cat "$tmp/client.stats" 2>/dev/null)"
ok=1
[ $rc -eq 0 ] || ok=0
grep -q "^Hello RDMA (you came from ipv4:127.0.0.1:[0-9]*?transport=rdma)" "$tmp/client.out" || ok=0
grep -q '"rdma_client_connections":1,' "$tmp/client.stats" 2>/dev/null || ok=0
grep -q '"tcp_client_connections":0,' "$tmp/client.stats" 2>/dev/null || ok=0
if [ $ok = 1 ]; then echo "1 passed, 0 failed"; exit 0; fi
echo "0 passed, 1 failed"; exit 1
