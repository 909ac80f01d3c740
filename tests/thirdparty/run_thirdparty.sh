#!/usr/bin/env bash
# run_thirdparty.sh - acceptance test for softverbs with unmodified Debian
# RDMA programs (ibverbs-utils, rdmacm-utils, perftest).
#
# usage: run_thirdparty.sh --launcher PATH/softverbs-run [--case NAME]... [--list]
#
# Every case runs twice: "lo-*" on loopback (device mlx5_0:127.0.0.1, the
# shared-memory wire) and "ns-*" across two network namespaces joined by a
# veth pair (the TCP wire).  Each case prints one line
#     PASS name (details)        or        FAIL name: reason
# followed, on failure, by the command lines and the tail of every program log.
# The last line is "N passed, M failed"; the exit status is 0 iff M == 0
# (2 on a usage error).
#
# Besides the programs' own verdicts, two-process cases check that the
# traffic really went through softverbs: each process writes its own
# SOFTVERBS_STATS file (expected opcodes must show tx ops > 0, and exact
# counts where the program's protocol fixes them) and runs with
# SOFTVERBS_TRACE=1, whose link lines must name the expected wire
# ("shm" on loopback, "tcp" across namespaces) and never the other one.
#
# One failure signature belongs to a Debian program itself, not to
# softverbs, and is handled explicitly and always named in the PASS details:
# perftest's -R listen race, whose built-in retry crashes (the case is re-run,
# at most twice, see perftest_hit_listen_race).  Everything else fails the
# case.
#
# Needs root for the namespace cases (ip netns).  Set
# RUN_THIRDPARTY_KEEP_LOGS=1 to keep the log directory.
set -u

PROG_TIMEOUT=60        # seconds, hard limit for every program
SERVER_GRACE=20        # seconds a server may take to exit after its client
READY_TIMEOUT=10       # seconds to wait for a server to listen
PP_ITERS=500           # ibv_rc_pingpong -n
RPING_COUNT=150        # rping -C
PERF_ITERS=100         # perftest -n
DEV=mlx5_0

usage() {
  echo "usage: $0 --launcher PATH_TO_softverbs-run [--case NAME]... [--list]" >&2
  exit 2
}

# ---------------------------------------------------------------- cases ----
TESTS=(ibv_devices ibv_devinfo
       rc_pingpong-s1 rc_pingpong-s4096 rc_pingpong-s65536 rc_pingpong-events
       rping-S100 rping-S4000 rping-q)
for t in ib_send_lat ib_write_lat ib_read_lat ib_write_bw ib_read_bw; do
  TESTS+=("$t" "$t-R")
done
ALL_CASES=()
for e in lo ns; do
  for t in "${TESTS[@]}"; do ALL_CASES+=("$e-$t"); done
done

LAUNCHER=""
LIST=0
SELECTED=()
while [ $# -gt 0 ]; do
  case "$1" in
    --launcher) [ $# -ge 2 ] || usage; LAUNCHER=$2; shift 2 ;;
    --launcher=*) LAUNCHER=${1#--launcher=}; shift ;;
    --case) [ $# -ge 2 ] || usage; SELECTED+=("$2"); shift 2 ;;
    --case=*) SELECTED+=("${1#--case=}"); shift ;;
    --list) LIST=1; shift ;;
    -h|--help) usage ;;
    *) echo "unknown argument: $1" >&2; usage ;;
  esac
done

if [ "$LIST" = 1 ]; then
  printf '%s\n' "${ALL_CASES[@]}"
  exit 0
fi
[ -n "$LAUNCHER" ] || usage
if [ ! -x "$LAUNCHER" ]; then
  echo "launcher not executable: $LAUNCHER" >&2
  exit 2
fi
LAUNCHER=$(cd "$(dirname "$LAUNCHER")" && pwd)/$(basename "$LAUNCHER")

case_index() {  # prints the index of case $1 in ALL_CASES, fails if unknown
  local i
  for i in "${!ALL_CASES[@]}"; do
    if [ "${ALL_CASES[$i]}" = "$1" ]; then echo "$i"; return 0; fi
  done
  return 1
}

if [ ${#SELECTED[@]} -eq 0 ]; then
  RUN_CASES=("${ALL_CASES[@]}")
else
  RUN_CASES=()
  for c in "${SELECTED[@]}"; do
    if ! case_index "$c" >/dev/null; then
      echo "unknown case: $c (see --list)" >&2
      exit 2
    fi
    RUN_CASES+=("$c")
  done
fi

# The script controls these itself; anything inherited would skew the checks.
unset SOFTVERBS_DEVICES SOFTVERBS_STATS SOFTVERBS_TRACE

# ------------------------------------------------------- global state ------
TMP_DIR=$(mktemp -d "${TMPDIR:-/tmp}/run_thirdparty.XXXXXX") || exit 2
LIVE_PIDS=()           # running programs (their `timeout` process)
NS_A="svtp-$$-a"
NS_B="svtp-$$-b"
VETH_A="svtpa$$"
VETH_B="svtpb$$"
NET_OCTET=$(( $$ % 250 + 1 ))
NS_ADDR_A="10.210.$NET_OCTET.1"
NS_ADDR_B="10.210.$NET_OCTET.2"
NS_STATE=none          # none | up | failed
NS_ERROR=""
# Ports.  Every port a case listens on stays out of Linux's ephemeral range
# (32768-60999 by default), where any outgoing connection on the machine may
# hold it at the moment the server binds ("Couldn't listen to port").  Cases
# whose server listens on TCP itself take ports from 20000-28199; rdma_cm
# cases take CM ports from 28232-32767, which softverbs serves on TCP ports
# P ^ 0x8000 = 61000-65535.  Concurrent runs (ctest -j) run different cases,
# and each case has its own index, so they never share a port.
PORT_SLOT=$(( $$ % 36 ))   # ranges hold 36 slots of 3 x ${#ALL_CASES[@]} ports
case_port() {  # CASE ATTEMPT(0..2): prints the port to use
  local idx n=${#ALL_CASES[@]} base p
  idx=$(case_index "$1") || return 1
  case "$1" in
    *-rping-*|*-R) base=28232 ;;
    *) base=20000 ;;
  esac
  p=$(( base + (PORT_SLOT * 3 + $2) * n + idx ))
  # A port still taken (another program, TIME_WAIT) moves on by a slot.
  local tries=0
  while [ $tries -lt 36 ] && port_taken "$p"; do
    p=$(( base + ((p - base + 3 * n) % (36 * 3 * n)) ))
    tries=$((tries + 1))
  done
  echo "$p"
}
port_taken() {  # PORT: true when it, or its softverbs CM twin, is in use here
  ss -tanH "( sport = :$1 or sport = :$(( $1 ^ 0x8000 )) )" 2>/dev/null | grep -q .
}

cleanup() {
  local p
  for p in "${LIVE_PIDS[@]}"; do
    [ -n "$p" ] || continue
    kill -TERM "$p" 2>/dev/null
  done
  for p in "${LIVE_PIDS[@]}"; do
    [ -n "$p" ] || continue
    wait "$p" 2>/dev/null
  done
  if [ "$NS_STATE" != none ]; then
    ip netns del "$NS_A" 2>/dev/null
    ip netns del "$NS_B" 2>/dev/null
    ip link del "$VETH_A" 2>/dev/null
  fi
  if [ "${RUN_THIRDPARTY_KEEP_LOGS:-0}" = 1 ]; then
    echo "logs kept in $TMP_DIR" >&2
  else
    rm -rf "$TMP_DIR"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

setup_netns() {
  [ "$NS_STATE" = none ] || return 0
  NS_STATE=failed
  local log="$TMP_DIR/netns-setup.log"
  {
    ip netns add "$NS_A" &&
    ip netns add "$NS_B" &&
    ip link add "$VETH_A" type veth peer name "$VETH_B" &&
    ip link set "$VETH_A" netns "$NS_A" &&
    ip link set "$VETH_B" netns "$NS_B" &&
    ip -n "$NS_A" addr add "$NS_ADDR_A/24" dev "$VETH_A" &&
    ip -n "$NS_B" addr add "$NS_ADDR_B/24" dev "$VETH_B" &&
    ip -n "$NS_A" link set lo up &&
    ip -n "$NS_B" link set lo up &&
    ip -n "$NS_A" link set "$VETH_A" up &&
    ip -n "$NS_B" link set "$VETH_B" up
  } >"$log" 2>&1
  if [ $? -ne 0 ]; then
    NS_ERROR="network namespace setup failed: $(tail -n 1 "$log")"
    return 1
  fi
  # Wait for the veth pair to carry traffic (carrier up, no tentative state).
  local i
  for ((i = 0; i < 50; i++)); do
    if ip -n "$NS_A" link show "$VETH_A" | grep -q 'state UP' &&
       ip -n "$NS_B" link show "$VETH_B" | grep -q 'state UP'; then
      break
    fi
    sleep 0.1
  done
  NS_STATE=up
  return 0
}

# --------------------------------------------------- per-case helpers ------
# Per-case state, set by run_case / setup_env / run_pair.
CASE=""; CASE_DIR=""; PORT=0; REASONS=(); NOTES=()
S_NS=""; C_NS=""; S_DEVS=""; C_DEVS=""; SERVER_ADDR=""; WIRE=""; OTHER_WIRE=""
SPID=""; SRC=0; CRC=0; SERVER_KILLED=0

fail() { REASONS+=("$*"); }
join_list() {  # joins its arguments with "; "
  local out="" x
  for x in "$@"; do out+="${out:+; }$x"; done
  printf '%s' "$out"
}
note() { NOTES+=("$*"); }

setup_env() {  # $1 = lo | ns
  if [ "$1" = lo ]; then
    S_NS=""; C_NS=""
    S_DEVS="$DEV:127.0.0.1"; C_DEVS="$DEV:127.0.0.1"
    SERVER_ADDR=127.0.0.1
    WIRE=shm; OTHER_WIRE=tcp
    return 0
  fi
  S_NS=$NS_A; C_NS=$NS_B
  S_DEVS="$DEV:$NS_ADDR_A"; C_DEVS="$DEV:$NS_ADDR_B"
  SERVER_ADDR=$NS_ADDR_A
  WIRE=tcp; OTHER_WIRE=shm
  setup_netns
}

# build_cmd ROLE PROG ARGS...: sets CMD to the full command line for ROLE
# (server | client | single) and records it in ROLE.cmd.
build_cmd() {
  local role=$1; shift
  local ns devs
  if [ "$role" = client ]; then ns=$C_NS; devs=$C_DEVS; else ns=$S_NS; devs=$S_DEVS; fi
  CMD=(timeout -k 5 "$PROG_TIMEOUT")
  [ -n "$ns" ] && CMD+=(ip netns exec "$ns")
  CMD+=(env "SOFTVERBS_DEVICES=$devs")
  if [ "$role" != single ]; then
    CMD+=("SOFTVERBS_STATS=$CASE_DIR/$role.stats" "SOFTVERBS_TRACE=1")
  fi
  CMD+=("$LAUNCHER" "$@")
  printf '%q ' "${CMD[@]}" >"$CASE_DIR/$role.cmd"
  echo >>"$CASE_DIR/$role.cmd"
}

# run_fg OUT ERR: runs CMD and waits for it.  It runs in the background so
# that a signal to this script is handled at once (bash defers traps while a
# foreground child runs); its exit code goes to CRC.
run_fg() {
  "${CMD[@]}" >"$1" 2>"$2" </dev/null &
  local pid=$!
  LIVE_PIDS+=("$pid")
  # (2>/dev/null keeps bash's own "Segmentation fault" job notices out)
  wait "$pid" 2>/dev/null
  CRC=$?
  forget_pid "$pid"
}

forget_pid() {
  local p kept=()
  for p in "${LIVE_PIDS[@]}"; do [ "$p" = "$1" ] || kept+=("$p"); done
  LIVE_PIDS=("${kept[@]}")
}

run_single() {  # PROG ARGS...: exit code in CRC
  build_cmd single "$@"
  run_fg "$CASE_DIR/single.out" "$CASE_DIR/single.err"
}

start_server() {  # PROG ARGS...
  build_cmd server "$@"
  "${CMD[@]}" >"$CASE_DIR/server.out" 2>"$CASE_DIR/server.err" </dev/null &
  SPID=$!
  LIVE_PIDS+=("$SPID")
  SERVER_KILLED=0
}

run_client() {  # PROG ARGS...: exit code in CRC
  build_cmd client "$@"
  run_fg "$CASE_DIR/client.out" "$CASE_DIR/client.err"
}

in_server_ns() {
  if [ -n "$S_NS" ]; then ip netns exec "$S_NS" "$@"; else "$@"; fi
}

# wait_ready port N | wait_ready cm N: waits until the server listens on TCP
# port N (programs that exchange QP data over their own socket), or on RDMA
# CM port N (softverbs' TCP port N ^ 0x8000); `cm` without N: until the
# server process owns any listening TCP socket.
wait_ready() {
  local kind=$1 port=${2:-} i prog=""
  for ((i = 0; i < READY_TIMEOUT * 10; i++)); do
    kill -0 "$SPID" 2>/dev/null || { note "server exited before listening"; return 1; }
    if [ "$kind" = port ]; then
      in_server_ns ss -ltnH "sport = :$port" 2>/dev/null | grep -q . && return 0
    elif [ -n "$port" ]; then
      # softverbs serves RDMA CM port P on TCP port P ^ 0x8000
      # (docs/softverbs.md); any other listener of the server (its QP
      # listener) may come up first.
      in_server_ns ss -ltnH "sport = :$((port ^ 0x8000))" 2>/dev/null | grep -q . && return 0
    else
      [ -n "$prog" ] || prog=$(pgrep -P "$SPID" 2>/dev/null | head -n 1)
      if [ -n "$prog" ] &&
         in_server_ns ss -ltnpH 2>/dev/null | grep -q "pid=$prog,"; then
        return 0
      fi
    fi
    sleep 0.1
  done
  note "server not listening after ${READY_TIMEOUT}s"
  return 1
}

# finish_server SECONDS: lets the server exit on its own for up to SECONDS,
# then kills it; its exit code goes to SRC.
finish_server() {
  local limit=$1 i
  for ((i = 0; i < limit * 10; i++)); do
    kill -0 "$SPID" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$SPID" 2>/dev/null; then
    SERVER_KILLED=1
    kill -TERM "$SPID" 2>/dev/null
  fi
  wait "$SPID" 2>/dev/null
  SRC=$?
  forget_pid "$SPID"
}

# Runs a client/server pair.  $1 = readiness kind (port | cm); then the
# server command, "--", the client command.
run_pair() {
  local kind=$1; shift
  local sargs=() cargs=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do sargs+=("$1"); shift; done
  shift
  cargs=("$@")
  start_server "${sargs[@]}"
  wait_ready "$kind" "$PORT"
  run_client "${cargs[@]}"
  if [ "$CRC" -eq 0 ]; then finish_server "$SERVER_GRACE"; else finish_server 3; fi
  [ "$SERVER_KILLED" = 1 ] && fail "server still running after its client exited; killed it"
  [ "$CRC" -eq 124 ] && fail "client timed out after ${PROG_TIMEOUT}s"
  [ "$SRC" -eq 124 ] && fail "server timed out after ${PROG_TIMEOUT}s"
}

check_exit() {  # ROLE CODE (124, a timeout, is reported by run_pair)
  local sig=""
  [ "$2" -eq 0 ] || [ "$2" -eq 124 ] && return 0
  if [ "$2" -gt 128 ] && sig=$(kill -l "$(( $2 - 128 ))" 2>/dev/null); then
    fail "$1 exited with status $2 (SIG$sig)"
  else
    fail "$1 exited with status $2"
  fi
}

# stat_sum ROLE DIR OP FIELD: sums FIELD (ops | bytes) over ROLE's stats lines.
stat_sum() {
  local f="$CASE_DIR/$1.stats"
  [ -f "$f" ] || { echo 0; return; }
  awk -v dir="dir=$2" -v op="op=$3" -v fld="$4=" '
    $1 == "softverbs-stats" {
      d = ""; o = ""; v = 0
      for (i = 2; i <= NF; i++) {
        if ($i == dir) d = 1
        if ($i == op) o = 1
        if (index($i, fld) == 1) v = substr($i, length(fld) + 1)
      }
      if (d && o) s += v
    }
    END { print s + 0 }' "$f"
}

# expect_tx ROLE OP [OPS [BYTES]]: ROLE must have initiated OP (ops > 0),
# exactly OPS times / BYTES bytes when given.  DIR defaults to tx; use
# expect_dir for rx.
expect_dir() {
  local role=$1 dir=$2 op=$3 want_ops=${4:-} want_bytes=${5:-}
  local ops bytes
  if [ ! -s "$CASE_DIR/$role.stats" ]; then
    case " ${NO_STATS_REPORTED:-} " in
      *" $role "*) ;;
      *) fail "no SOFTVERBS_STATS output from the $role"
         NO_STATS_REPORTED="${NO_STATS_REPORTED:-} $role" ;;
    esac
    return
  fi
  ops=$(stat_sum "$role" "$dir" "$op" ops)
  bytes=$(stat_sum "$role" "$dir" "$op" bytes)
  if [ "$ops" -le 0 ]; then
    fail "$role stats: no $dir $op operations"
  elif [ -n "$want_ops" ] && [ "$ops" -ne "$want_ops" ]; then
    fail "$role stats: $dir $op ops=$ops, expected $want_ops"
  elif [ -n "$want_bytes" ] && [ "$bytes" -ne "$want_bytes" ]; then
    fail "$role stats: $dir $op bytes=$bytes, expected $want_bytes"
  fi
}
expect_tx() { expect_dir "$1" tx "${@:2}"; }

# check_wire: both processes' trace output must name $WIRE and never
# $OTHER_WIRE in softverbs' own lines.
check_wire() {
  local role f
  for role in server client; do
    f="$CASE_DIR/$role.err"
    if ! grep -Eq "softverbs\[[0-9]+\]:.*\b$WIRE\b" "$f"; then
      fail "$role trace shows no '$WIRE' link (expected the $WIRE wire)"
    fi
    if grep -Eq "softverbs\[[0-9]+\]:.*\b$OTHER_WIRE\b" "$f"; then
      fail "$role trace shows a '$OTHER_WIRE' link (expected only $WIRE)"
    fi
  done
}

need_prog() {
  command -v "$1" >/dev/null 2>&1 || { fail "program $1 not installed"; return 1; }
}

show_logs() {
  local f role
  for f in "$CASE_DIR"/*.cmd; do
    [ -e "$f" ] || continue
    role=$(basename "$f" .cmd)
    echo "  ---- $role command: $(cat "$f")"
    if [ -s "$CASE_DIR/$role.out" ]; then
      echo "  ---- $role stdout (last 20 lines):"
      tail -n 20 "$CASE_DIR/$role.out" | cut -c1-240 | sed 's/^/  | /'
    fi
    if [ -s "$CASE_DIR/$role.err" ]; then
      echo "  ---- $role stderr (last 20 lines):"
      tail -n 20 "$CASE_DIR/$role.err" | cut -c1-240 | sed 's/^/  | /'
    fi
    if [ -s "$CASE_DIR/$role.stats" ]; then
      echo "  ---- $role stats:"
      sed 's/^/  | /' "$CASE_DIR/$role.stats"
    fi
  done
}

# ------------------------------------------------------------ the cases ----
case_devices() {  # $1 = ibv_devices | ibv_devinfo
  need_prog "$1" || return
  run_single "$1"
  local out="$CASE_DIR/single.out"
  check_exit "$1" "$CRC"
  if [ "$1" = ibv_devices ]; then
    grep -Eq "^[[:space:]]*$DEV[[:space:]]" "$out" || fail "$DEV not listed"
    note "$(grep -E "^[[:space:]]*$DEV[[:space:]]" "$out" | head -n 1 | xargs)"
  else
    grep -Eq "hca_id:[[:space:]]*$DEV\$" "$out" || fail "hca_id $DEV not listed"
    grep -q "PORT_ACTIVE" "$out" || fail "port not PORT_ACTIVE"
    note "hca_id $DEV, $(grep -m1 -o 'PORT_ACTIVE' "$out"), $(grep -m1 -E 'link_layer' "$out" | xargs)"
  fi
}

case_rc_pingpong() {  # $1 = size, $2 = extra flag (-e or empty)
  need_prog ibv_rc_pingpong || return
  local size=$1 extra=() args
  [ -n "${2:-}" ] && extra=("$2")
  args=(-d "$DEV" -p "$PORT" -s "$size" -n "$PP_ITERS" -c "${extra[@]}")
  run_pair port ibv_rc_pingpong "${args[@]}" -- ibv_rc_pingpong "${args[@]}" "$SERVER_ADDR"
  check_exit server "$SRC"
  check_exit client "$CRC"
  grep -q "iters in" "$CASE_DIR/client.out" || fail "client did not print 'iters in'"
  note "$(grep -m1 'iters in' "$CASE_DIR/client.out")"
  local role
  for role in server client; do
    expect_tx "$role" SEND "$PP_ITERS" $((PP_ITERS * size))
    expect_dir "$role" rx RECV "$PP_ITERS" $((PP_ITERS * size))
  done
  check_wire
  note "stats: tx SEND ${PP_ITERS}x${size}B each side"
  note "wire $WIRE"
}

case_rping() {  # $1 = size, then extra rping options (-q: the app makes its own QP)
  need_prog rping || return
  local size=$1 n=$RPING_COUNT
  shift
  local common=(-p "$PORT" -v -V -C "$n" -S "$size" "$@")
  run_pair cm rping -s -a "$SERVER_ADDR" "${common[@]}" -- rping -c -a "$SERVER_ADDR" "${common[@]}"
  check_exit server "$SRC"
  check_exit client "$CRC"
  local got last
  got=$(grep -c '^ping data: rdma-ping-' "$CASE_DIR/client.out")
  [ "$got" -eq "$n" ] || fail "client printed $got 'ping data' lines, expected $n"
  last=$(grep '^ping data: rdma-ping-' "$CASE_DIR/client.out" | tail -n 1 | cut -d: -f2 | xargs)
  [ "$got" -eq 0 ] || [ "$last" = "rdma-ping-$((n - 1))" ] || fail "last ping is '$last', expected rdma-ping-$((n - 1))"
  grep -q "data mismatch" "$CASE_DIR/client.err" && fail "client reported a data mismatch"
  # rping's CM handler prints the role taken from the cm_id's context; the
  # wrong role means an event was delivered with a stale (destroyed) cm_id.
  grep -q "^client DISCONNECT EVENT" "$CASE_DIR/server.err" &&
    fail "server printed 'client DISCONNECT EVENT': CM event delivered with a stale rdma_cm_id/context"
  grep -q "^server DISCONNECT EVENT" "$CASE_DIR/client.err" &&
    fail "client printed 'server DISCONNECT EVENT': CM event delivered with a stale rdma_cm_id/context"
  # Per ping: client SENDs 2 adverts; server RDMA_READs the ping, SENDs
  # go-ahead, RDMA_WRITEs the echo (size bytes incl. NUL), SENDs go-ahead.
  expect_tx server RDMA_READ "$n" $((n * size))
  expect_tx server RDMA_WRITE "$n" $((n * size))
  expect_tx server SEND $((2 * n))
  expect_tx client SEND $((2 * n))
  expect_dir client rx RDMA_READ "$n" $((n * size))
  expect_dir client rx RDMA_WRITE "$n" $((n * size))
  check_wire
  note "client: $got validated pings of ${size}B"
  note "stats: server tx RDMA_READ=$n RDMA_WRITE=$n SEND=$((2 * n))"
  note "wire $WIRE"
}

# perftest's own -R race: after the first (control) rdma_cm connection the
# client connects its data QP at once, while the server only then creates
# and listens on the data id.  When the client wins, the connect is
# rejected (RDMA_CM_EVENT_REJECTED, status 8 = no listener, as on IB), and
# perftest 4.5's built-in retry loop then crashes (SIGSEGV: it passes an
# rdma_cm_id read from freed memory to rdma_resolve_addr).  Real HCAs take
# milliseconds to resolve address and route, so the race rarely shows
# there.  On exactly that signature the case is run once more (new port)
# and the retry is reported in the details; any other failure counts.
perftest_hit_listen_race() {
  grep -q "RDMA_CM_EVENT_REJECTED; error: 8" "$CASE_DIR/client.err" &&
    grep -Eq "softverbs\[[0-9]+\]: ([0-9:.]+ )?link cm-connect: connect: Connection refused" "$CASE_DIR/client.err"
}

perftest_attempt() {  # program, -R or empty
  local prog=$1 rdmacm=${2:-}
  local args=(-d "$DEV" -n "$PERF_ITERS" -p "$PORT") kind=port
  if [ -n "$rdmacm" ]; then args+=(-R); kind=cm; fi
  run_pair "$kind" "$prog" "${args[@]}" -- "$prog" "${args[@]}" "$SERVER_ADDR"
  check_exit server "$SRC"
  check_exit client "$CRC"
  PERF_ROW=$(grep -E '^ *[0-9]+ +[0-9]+' "$CASE_DIR/client.out" | head -n 1 | xargs)
  [ -n "$PERF_ROW" ] || fail "client printed no results row"
  case "$prog" in
    ib_send_lat)  expect_tx server SEND; expect_tx client SEND ;;
    ib_write_lat) expect_tx server RDMA_WRITE; expect_tx client RDMA_WRITE ;;
    ib_read_lat)  expect_tx client RDMA_READ; expect_dir server rx RDMA_READ ;;
    ib_write_bw)  expect_tx client RDMA_WRITE; expect_dir server rx RDMA_WRITE ;;
    ib_read_bw)   expect_tx client RDMA_READ; expect_dir server rx RDMA_READ ;;
  esac
  check_wire
}

case_perftest() {  # $1 = program, $2 = -R or empty
  local prog=$1 rdmacm=${2:-}
  need_prog "$prog" || return
  PERF_ROW=""
  perftest_attempt "$prog" "$rdmacm"
  local attempt=1
  while [ ${#REASONS[@]} -gt 0 ] && [ -n "$rdmacm" ] && [ "$attempt" -lt 3 ] &&
        perftest_hit_listen_race; do
    mkdir -p "$CASE_DIR/attempt$attempt"
    mv "$CASE_DIR"/server.* "$CASE_DIR"/client.* "$CASE_DIR/attempt$attempt/" 2>/dev/null
    note "attempt $attempt lost perftest's own -R listen race (data connect REJECTED status 8, then client status $CRC; perftest bug, see script), retried"
    REASONS=(); NO_STATS_REPORTED=""
    attempt=$((attempt + 1))
    PORT=$(case_port "$CASE" $((attempt - 1)))
    perftest_attempt "$prog" "$rdmacm"
  done
  note "client: $PERF_ROW"
  note "wire $WIRE"
}

run_case() {
  CASE=$1
  CASE_DIR="$TMP_DIR/$CASE"
  mkdir -p "$CASE_DIR"
  REASONS=(); NOTES=(); NO_STATS_REPORTED=""
  PORT=$(case_port "$CASE" 0)
  local env=${CASE%%-*} test=${CASE#*-} t0 t1
  t0=$(date +%s%N)
  if ! setup_env "$env"; then
    fail "$NS_ERROR"
  else
    case "$test" in
      ibv_devices|ibv_devinfo) case_devices "$test" ;;
      rc_pingpong-events) case_rc_pingpong 4096 -e ;;
      rc_pingpong-s*) case_rc_pingpong "${test#rc_pingpong-s}" ;;
      rping-S*) case_rping "${test#rping-S}" ;;
      rping-q) case_rping 100 -q ;;
      ib_*-R) case_perftest "${test%-R}" -R ;;
      ib_*) case_perftest "$test" ;;
      *) fail "internal error: no such test $test" ;;
    esac
  fi
  t1=$(date +%s%N)
  local secs
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  if [ ${#REASONS[@]} -eq 0 ]; then
    echo "PASS $CASE ($(join_list "${NOTES[@]}" "${secs}s"))"
    PASSED=$((PASSED + 1))
  else
    echo "FAIL $CASE: $(join_list "${REASONS[@]}") (${secs}s)"
    [ ${#NOTES[@]} -gt 0 ] && echo "  ---- notes: $(join_list "${NOTES[@]}")"
    show_logs
    FAILED=$((FAILED + 1))
  fi
}

PASSED=0
FAILED=0
T_START=$(date +%s)
for c in "${RUN_CASES[@]}"; do
  run_case "$c"
done
echo "total time $(( $(date +%s) - T_START ))s"
echo "$PASSED passed, $FAILED failed"
[ "$FAILED" -eq 0 ]
