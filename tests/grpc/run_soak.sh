#!/usr/bin/env bash
# run_soak.sh - the gRPC soak: one echo server and one soak client
# (tests/grpc/soak_client.cc), both with grpc-rdma preloaded over softverbs,
# for a bounded time, with faults injected on both sides and every byte
# checked.
#
# usage: run_soak.sh --build BUILD_DIR [--seconds S] [--quiet Q]
#                    [--fault-every F] [--faults LIST] [--workers N] [--seed X]
#                    [--netns] [--defaults]
#   --seconds      how long the client runs (default 60)
#   --quiet        the last Q seconds have no server faults (default S/4)
#   --fault-every  a server fault every F seconds on average (default 15):
#                  killed (SIGKILL) and restarted on its port, or stopped
#                  (SIGSTOP) for 1-3 s and continued, in turn
#   --faults       which of them: kill,stop (default), kill, stop, or none.
#                  Without stops, no address may be remembered as
#                  TCP-only, and TCP may carry only connections whose RDMA
#                  attempt raced a restart (refused while the server was
#                  down, TCP reaching it just after): at most one per worker
#                  per kill (the client's RDMA connect timeout is raised to
#                  10 s so that a slow CPU is not taken for a missing
#                  listener). A stopped server does not answer RDMA CM in
#                  time and the client rightly falls back to TCP: with
#                  stops, TCP connections are counted only
#   --netns        server and client in two network namespaces joined by a
#                  veth pair (two hosts), instead of loopback
#   --defaults     the plugin's defaults: connections start on TCP and move
#                  to RDMA (TF_RDMA_TCP_FIRST). The checks on TCP then
#                  count the connections whose RDMA connection beside them
#                  failed (a channel that closes before RDMA is up never
#                  moves, by design); without it the clients wait for RDMA
#                  CM, so that every connection rides RDMA from its start
#
# The client's own faults (cancelled calls, deadlines too short) and its
# checks are soak_client's. After the client: the server must hold no
# RDMA connection and no pinned memory within 15 s; then a second, short
# client without faults must run all-OK over RDMA (no TCP connection), and
# after it the server's descriptors, threads and heap in use (malloc's,
# within 512 KiB) must be back to what they were before it (nothing kept per
# connection or per call). Prints progress every 10 s
# and "PASS soak ..." or "FAIL soak: ...". Exit 0 iff it passed.
# SOAK_KEEP=1 keeps the logs and stats files (their directory is printed).
# SOAK_THREAD_SLACK=N lets the server end the second client with up to N
# threads more than before it (default 0; 2 with --defaults). scripts/tsan.sh
# sets 2: under ThreadSanitizer's slower calls a server restarted late in
# the soak was still growing gRPC's thread pool (16 to 17 threads in one CI
# run). With --defaults the same was seen without it (15 to 16 in one CI
# run, its descriptors back where they were): each connection's start on
# TCP and move give gRPC's pool more to do. A thread kept per connection
# or per call would be dozens (the second client makes about 50).
set -u

BUILD="" SECONDS_RUN=60 QUIET="" FAULT_EVERY=15 FAULTS=kill,stop WORKERS=4 SEED=$RANDOM NETNS=0
DEFAULTS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --seconds) SECONDS_RUN=$2; shift 2 ;;
    --quiet) QUIET=$2; shift 2 ;;
    --fault-every) FAULT_EVERY=$2; shift 2 ;;
    --faults) FAULTS=$2; shift 2 ;;
    --workers) WORKERS=$2; shift 2 ;;
    --seed) SEED=$2; shift 2 ;;
    --netns) NETNS=1; shift ;;
    --defaults) DEFAULTS=1; shift ;;
    *) echo "usage: $0 --build BUILD_DIR [--seconds S] [--quiet Q] [--fault-every F] [--faults LIST] [--workers N] [--seed X] [--netns] [--defaults]" >&2
       exit 2 ;;
  esac
done
[ -n "$BUILD" ] || { echo "usage: $0 --build BUILD_DIR ..." >&2; exit 2; }
THREAD_SLACK=${SOAK_THREAD_SLACK:-$(( DEFAULTS * 2 ))}
case $THREAD_SLACK in ''|*[!0-9]*) echo "run_soak.sh: SOAK_THREAD_SLACK='$THREAD_SLACK' is not a number" >&2; exit 2 ;; esac
[ -n "$QUIET" ] || QUIET=$(( SECONDS_RUN / 4 ))
for n in "$SECONDS_RUN" "$QUIET" "$FAULT_EVERY" "$WORKERS" "$SEED"; do
  case "$n" in ''|*[!0-9]*) echo "run_soak.sh: '$n' is not a whole number" >&2; exit 2 ;; esac
done
case "$FAULTS" in
  kill,stop|stop,kill) FAULTS=kill,stop ;;
  kill|stop|none) ;;
  *) echo "run_soak.sh: --faults takes kill,stop, kill, stop or none, not '$FAULTS'" >&2; exit 2 ;;
esac
[ "$QUIET" -lt "$SECONDS_RUN" ] && [ "$FAULT_EVERY" -ge 2 ] ||
  { echo "run_soak.sh: --quiet must be below --seconds and --fault-every at least 2" >&2; exit 2; }

SERVER_TOOL=$BUILD/tests/grpc/echo_tool
CLIENT_TOOL=$BUILD/tests/grpc/soak_client
LIB=$BUILD/src/glue/libgrpc_rdma.so
# Unless --defaults: it checks that every connection rides RDMA from its
# start, after each restart too, so its clients wait for RDMA CM instead of
# starting on TCP.
if [ "$DEFAULTS" = 1 ]; then unset TF_RDMA_TCP_FIRST; else export TF_RDMA_TCP_FIRST=0; fi
RUN=$BUILD/softverbs/softverbs-run
for f in "$SERVER_TOOL" "$CLIENT_TOOL" "$LIB" "$RUN"; do
  [ -e "$f" ] || { echo "FAIL soak: $f is missing (build the tree first)"; exit 1; }
done
TMP=$(mktemp -d "${TMPDIR:-/tmp}/grpc_soak.XXXXXX")
NS_S="grpcsk-$$-s" NS_C="grpcsk-$$-c" VETH_S="gss$$" VETH_C="gsc$$"
OCTET=$(( $$ % 250 + 1 ))
ADDR_S=127.0.0.1 ADDR_C=127.0.0.1 PRE_S=() PRE_C=()
SERVER_PID="" PORT=0
RANDOM=$SEED

CLIENT=""
cleanup() {
  [ -n "$CLIENT" ] && kill -KILL "$CLIENT" 2>/dev/null
  [ -n "$SERVER_PID" ] && kill -CONT "$SERVER_PID" 2>/dev/null && kill "$SERVER_PID" 2>/dev/null
  exec 8>&- 2>/dev/null
  if [ "$NETNS" = 1 ]; then ip netns del "$NS_S" 2>/dev/null; ip netns del "$NS_C" 2>/dev/null; fi
  if [ -n "${SOAK_KEEP:-}" ]; then echo "soak: kept $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
die() {
  echo "FAIL soak: $*"
  for f in server.err client.out client.err client2.out client2.err; do
    [ -s "$TMP/$f" ] && { echo "---- $f (last lines)"; tail -n 15 "$TMP/$f" | sed 's/^/  | /'; }
  done
  exit 1
}

# stat KEY: a top-level number of the server's stats file (rewritten every
# second), empty if none yet.
stat() {
  python3 - "$TMP/server.stats" "$1" <<'PY' 2>/dev/null
import json, sys
try:
    v = json.load(open(sys.argv[1]))[sys.argv[2]]
    print(v if isinstance(v, int) else "")
except (OSError, ValueError, KeyError, TypeError):
    pass
PY
}

# The server process itself (softverbs-run execs it; ip netns exec too).
server_fds() { ls "/proc/$SERVER_PID/fd" 2>/dev/null | wc -l; }
server_threads() { awk '/^Threads:/{print $2}' "/proc/$SERVER_PID/status" 2>/dev/null; }
server_rss_kb() { awk '/^VmRSS:/{print $2}' "/proc/$SERVER_PID/status" 2>/dev/null; }
# What of it malloc has handed out and not had back (the server writes it
# each second, with a count of writes): RSS also holds what malloc keeps
# after a free.
server_heap_kb() { awk '{print int($1 / 1024)}' "$TMP/server.heap" 2>/dev/null; }
# fresh_heap_kb: the heap in use as the server sees it from now on: waits
# (up to 10 s) for two more writes, so that the figure was taken after
# this moment, whatever the writer's timing.
fresh_heap_kb() {
  local n0 n
  n0=$(awk '{print $2}' "$TMP/server.heap" 2>/dev/null)
  for _ in $(seq 1 100); do
    n=$(awk '{print $2}' "$TMP/server.heap" 2>/dev/null)
    [ -n "$n0" ] && [ -n "$n" ] && [ "$n" -ge $(( n0 + 2 )) ] && break
    sleep 0.1
  done
  server_heap_kb
}

# start_server PORT: echo_tool serve on ADDR_S:PORT (0: any); sets PORT.
start_server() {
  rm -f "$TMP/stdin" "$TMP/server.out"
  mkfifo "$TMP/stdin"
  # A connection accepted but not established within the connect timeout
  # is dropped: 10 s, so that a slow CPU (CI runs this beside other tests)
  # is not taken for a peer that never finished.
  # The server closes a connection with no call for 3 s (a setting servers
  # whose clients come and go use): gRPC 1.51 keeps, with no channel, a
  # connection whose subchannel was shut down while it waited for the
  # server's SETTINGS (grpc/grpc#32071), until its server closes it. The
  # client's end check (within 10 s, the plugin holds nothing) then holds
  # for those too; the workers' own channels are never idle that long.
  "${PRE_S[@]}" env TF_RDMA_STATS="$TMP/server.stats" TF_RDMA_STATS_INTERVAL_S=1 \
    TF_RDMA_CONNECT_TIMEOUT_MS=10000 \
    "SOFTVERBS_DEVICES=mlx5_0:$ADDR_S" "$RUN" --preload "$LIB" \
    "$SERVER_TOOL" serve "$ADDR_S:$1" --max-idle-ms 3000 --heap-file "$TMP/server.heap" \
    <"$TMP/stdin" >"$TMP/server.out" 2>>"$TMP/server.err" &
  SERVER_PID=$!
  exec 8>"$TMP/stdin"
  local p=""
  for _ in $(seq 1 150); do
    p=$(awk '/^port /{print $2}' "$TMP/server.out" 2>/dev/null)
    [ -n "$p" ] && break
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 0.1
  done
  [ -n "$p" ] || die "the server did not start on port $1"
  PORT=$p
}

# A server's crash or sanitizer report is a failure even when it happened
# while faults were allowed (a restart would hide it otherwise).
check_server_log() {
  check_log server.err
}
# check_log FILE: a sanitizer report, an abort or a failed assertion in it
# fails the soak (a UBSan report does not change the exit status).
BAD_LINES="AddressSanitizer|LeakSanitizer|runtime error:|terminate called|Assertion .* failed|assertion failed|Check failed"
check_log() {
  if grep -qE "$BAD_LINES" "$TMP/$1" 2>/dev/null; then
    die "$1 says: $(grep -m1 -E "$BAD_LINES" "$TMP/$1")"
  fi
}

# wait_idle SECONDS: until the server holds no RDMA connection and no
# pinned memory (its stats file says so); false if it still does.
wait_idle() {
  local i open pinned
  for ((i = 0; i < $1 * 10; i++)); do
    open=$(stat rdma_connections_open) pinned=$(stat pinned_bytes)
    [ "$open" = 0 ] && [ "$pinned" = 0 ] && return 0
    sleep 0.1
  done
  echo "  the server still holds ${open:-?} RDMA connections and ${pinned:-?} pinned bytes"
  return 1
}

if [ "$NETNS" = 1 ]; then
  ADDR_S="10.212.$OCTET.1" ADDR_C="10.212.$OCTET.2"
  { ip netns add "$NS_S" && ip netns add "$NS_C" &&
    ip link add "$VETH_S" type veth peer name "$VETH_C" &&
    ip link set "$VETH_S" netns "$NS_S" && ip link set "$VETH_C" netns "$NS_C" &&
    ip -n "$NS_S" addr add "$ADDR_S/24" dev "$VETH_S" &&
    ip -n "$NS_C" addr add "$ADDR_C/24" dev "$VETH_C" &&
    ip -n "$NS_S" link set lo up && ip -n "$NS_C" link set lo up &&
    ip -n "$NS_S" link set "$VETH_S" up && ip -n "$NS_C" link set "$VETH_C" up; } ||
    die "cannot make two network namespaces (needs root)"
  PRE_S=(ip netns exec "$NS_S") PRE_C=(ip netns exec "$NS_C")
fi

echo "soak: ${SECONDS_RUN} s, the last ${QUIET} quiet, server faults ($FAULTS) every ~${FAULT_EVERY} s," \
     "$WORKERS workers, seed $SEED, $([ "$NETNS" = 1 ] && echo "two network namespaces" || echo loopback)"
start_server 0
CLIENT_ENV=()
case "$FAULTS" in *stop*) ;; *) CLIENT_ENV=(TF_RDMA_CONNECT_TIMEOUT_MS=10000) ;; esac
"${PRE_C[@]}" env TF_RDMA_STATS="$TMP/client.stats" "SOFTVERBS_DEVICES=mlx5_0:$ADDR_C" \
  "${CLIENT_ENV[@]}" \
  "$RUN" --preload "$LIB" "$CLIENT_TOOL" "$ADDR_S:$PORT" "$SECONDS_RUN" "$QUIET" \
  --workers "$WORKERS" --seed "$SEED" >"$TMP/client.out" 2>"$TMP/client.err" 8>&- &
CLIENT=$!
t0=$(date +%s)
faults_end=$(( t0 + SECONDS_RUN - QUIET ))
kills=0 stops=0 shown=0 last_server_line=$t0
next=$(( t0 + FAULT_EVERY / 2 + RANDOM % FAULT_EVERY ))
# The client's calls each have a deadline (30 s at most) and it checks them,
# but only for calls that return: past this, it is hung.
hang_at=$(( t0 + SECONDS_RUN + 120 ))
while kill -0 "$CLIENT" 2>/dev/null; do
  sleep 1
  now=$(date +%s)
  if [ "$now" -ge "$hang_at" ]; then
    kill -ABRT "$CLIENT" 2>/dev/null
    for _ in $(seq 1 100); do kill -0 "$CLIENT" 2>/dev/null || break; sleep 0.1; done
    die "the soak client still ran 120 s after its end: hung (SIGABRT sent; what it printed is in client.err)"
  fi
  # The server may go only when we kill it: gone by itself, it crashed.
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    wait "$SERVER_PID"
    st=$?
    SERVER_PID=""
    die "the server died by itself at $(( now - t0 ))s (exit status $st; not a fault of ours)"
  fi
  # The client's progress lines, as they come.
  lines=$(wc -l <"$TMP/client.out")
  if [ "$lines" -gt "$shown" ]; then
    tail -n +$(( shown + 1 )) "$TMP/client.out" | head -n $(( lines - shown ))
    shown=$lines
  fi
  # The server's side, each minute (what a leak would show first).
  if [ $(( now - last_server_line )) -ge 60 ]; then
    last_server_line=$now
    echo "soak: server at $(( now - t0 ))s: $(server_fds) fds, $(server_threads) threads," \
         "RSS $(( $(server_rss_kb || echo 0) / 1024 )) MiB (heap in use" \
         "$(server_heap_kb) KiB), $(stat rdma_connections_open)" \
         "RDMA connections open, $(stat pinned_bytes) bytes pinned"
  fi
  [ "$FAULTS" != none ] && [ "$now" -ge "$next" ] && [ "$now" -lt $(( faults_end - 3 )) ] ||
    continue
  next=$(( now + FAULT_EVERY / 2 + RANDOM % FAULT_EVERY ))
  if [ "$FAULTS" = kill ] || { [ "$FAULTS" = kill,stop ] && [ $(( (kills + stops) % 2 )) -eq 0 ]; }; then
    kills=$(( kills + 1 ))
    echo "soak: fault at $(( now - t0 ))s: the server is killed (SIGKILL) and restarted"
    kill -KILL "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
    st=$?
    # 137: our SIGKILL. Anything else: it had ended by itself just before.
    [ "$st" -eq 137 ] || { SERVER_PID=""; die "the server had ended by itself (exit status $st) when it was to be killed"; }
    check_server_log
    exec 8>&-
    sleep "0.$(( RANDOM % 10 ))"
    start_server "$PORT"
  else
    stops=$(( stops + 1 ))
    pause=$(( 1 + RANDOM % 3 ))
    echo "soak: fault at $(( now - t0 ))s: the server is stopped (SIGSTOP) for $pause s"
    kill -STOP "$SERVER_PID"
    sleep "$pause"
    kill -CONT "$SERVER_PID"
  fi
done
wait "$CLIENT"
rc=$?
CLIENT=""
check_log client.err
tail -n +$(( shown + 1 )) "$TMP/client.out"
[ "$rc" -eq 0 ] || die "the soak client failed (exit $rc), $kills kills and $stops stops of the server"
grep -q "^soak: ok" "$TMP/client.out" || die "the soak client printed no result"
cstat() {
  python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2" 2>/dev/null
}
tcp=$(cstat "$TMP/client.stats" tcp_client_connections)
moved=$(cstat "$TMP/client.stats" tcp_first_moved)
echo "soak: client connections: $(cstat "$TMP/client.stats" rdma_client_connections) RDMA," \
     "${tcp:-?} TCP, ${moved:-?} of them moved to RDMA ($(cstat "$TMP/client.stats" fallbacks)" \
     "fallbacks, of which $(cstat "$TMP/client.stats" fallbacks_remembered) remembered)"
# With the defaults every connection starts on TCP: those whose RDMA
# connection beside it failed (fallbacks) are what stayed there for a
# reason the checks below weigh. One whose channel closed before RDMA was
# up (a channel of a few fast calls) never moves, by design, and counts
# in no fallback.
[ "$DEFAULTS" = 1 ] && tcp=$(cstat "$TMP/client.stats" fallbacks)
# Without stops, no address may be remembered as TCP-only, and TCP carries
# only connections whose RDMA attempt raced a restart (refused before the
# server was up, TCP tried after): at most one per worker per kill.
remembered=$(cstat "$TMP/client.stats" fallbacks_remembered)
case "$FAULTS" in
  *stop*) ;;
  *) [ "$remembered" = 0 ] ||
       die "${remembered:-?} connections went to TCP at once with no stopped server: a restart made the client remember the server as without RDMA"
     [ -n "$tcp" ] && [ "$tcp" -le $(( kills * WORKERS )) ] ||
       die "${tcp:-?} client connections went by TCP with $kills restarts and $WORKERS workers: after a restart, connections must ride RDMA again" ;;
esac

check_server_log
wait_idle 15 || die "the server kept connections or pinned memory 15 s after the client ended"
heap0=$(fresh_heap_kb)  # taken after the last connection went
fds0=$(server_fds) thr0=$(server_threads) rss0=$(server_rss_kb)
# A second client, no faults at all: all OK, all RDMA, and the server gives
# back every descriptor and thread the connections took.
"${PRE_C[@]}" env TF_RDMA_STATS="$TMP/client2.stats" "SOFTVERBS_DEVICES=mlx5_0:$ADDR_C" \
  TF_RDMA_CONNECT_TIMEOUT_MS=10000 \
  timeout -s ABRT -k 10 90 \
  "$RUN" --preload "$LIB" "$CLIENT_TOOL" "$ADDR_S:$PORT" 10 10 --workers 2 --seed "$SEED" \
  --grace 0 >"$TMP/client2.out" 2>"$TMP/client2.err" 8>&- ||
  die "the second client (no faults) failed (124 or 134: it hung for 90 s)"
check_log client2.err
tail -n 1 "$TMP/client2.out"
tcp=$(cstat "$TMP/client2.stats" tcp_client_connections)
if [ "$DEFAULTS" = 1 ]; then
  # Every connection moves or closes first: none stays on TCP for a failed
  # or refused RDMA connection.
  moved=$(cstat "$TMP/client2.stats" tcp_first_moved)
  fb=$(cstat "$TMP/client2.stats" fallbacks)
  unjoined=$(cstat "$TMP/client2.stats" tcp_first_unjoined)
  echo "soak: second client: ${tcp:-?} connections started on TCP, ${moved:-?} moved to RDMA" \
       "(the rest closed first), ${fb:-?} fallbacks, ${unjoined:-?} not joined"
  [ -n "$moved" ] && [ "$moved" -ge 1 ] && [ "$fb" = 0 ] && [ "$unjoined" = 0 ] ||
    die "the second client's connections: ${tcp:-?} started on TCP, ${moved:-?} moved, ${fb:-?} fell back, ${unjoined:-?} not joined: each must move or close first"
else
  [ "$tcp" = 0 ] || die "the second client made ${tcp:-?} TCP connections: new clients must still ride RDMA"
fi
wait_idle 15 || die "the server kept connections or pinned memory after the second client"
fds1="" thr1=""
for _ in $(seq 1 150); do
  fds1=$(server_fds) thr1=$(server_threads)
  [ "$fds1" -le "$fds0" ] && [ "$thr1" -le $(( thr0 + THREAD_SLACK )) ] && break
  sleep 0.1
done
rss1=$(server_rss_kb) heap1=$(fresh_heap_kb)
echo "soak: server after the soak: $fds0 fds, $thr0 threads, RSS $(( rss0 / 1024 )) MiB" \
     "(heap in use ${heap0:-?} KiB); after the second client: $fds1 fds, $thr1 threads," \
     "RSS $(( rss1 / 1024 )) MiB (heap in use ${heap1:-?} KiB)"
[ "$fds1" -le "$fds0" ] || die "the server's descriptors grew from $fds0 to $fds1 over the second client"
[ "$thr1" -le $(( thr0 + THREAD_SLACK )) ] ||
  die "the server's threads grew from $thr0 to $thr1 over the second client (slack $THREAD_SLACK)"
# malloc's heap in use, all connections gone, before and after the second
# client's dozens of connections and thousands of calls: what a leak per
# connection or per call would leave (seen: -9 to +62 KiB). RSS is not
# checked: it holds what malloc keeps after a free (TF_RDMA_MALLOC_TUNE).
# Under ASan, whose malloc mallinfo2 does not see, both read 0.
[ -n "$heap0" ] && [ -n "$heap1" ] || die "the server wrote no heap figure ($TMP/server.heap)"
[ "$heap1" -le $(( heap0 + 512 )) ] ||
  die "the server's heap in use grew from $heap0 KiB to $heap1 KiB over the second client (a leak?)"
exec 8>&-
for _ in $(seq 1 150); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
kill -0 "$SERVER_PID" 2>/dev/null && die "the server did not stop within 15 s of being told"
wait "$SERVER_PID" || die "the server exited with $?"
SERVER_PID=""
check_server_log
echo "PASS soak: ${SECONDS_RUN} s, $kills server kills, $stops server stops, every byte checked"
