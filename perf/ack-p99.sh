#!/usr/bin/env bash
# The broker issue's latency target, measured the way perf/README measures
# it: publish-ack p99 under 2 ms at half of the peak durable publish rate.
#
# Starts a standalone broker (`felix serve`, durable, on BROKER-CPUS), finds
# the closed-loop peak (4 producers x 8 batches in flight x 100 records of
# 100 B, 2 shards), then runs open loop at half of it RUNS times (64 batches
# in flight, paced) and prints each run's acknowledgement p50/p99, the
# broker's own p99 and how the CPUs divided between broker and client. On a
# machine with CPUs to spare, give the client its own with --client-cpus:
# that is the measurement the 2-vCPU development VM cannot make.
#
#   perf/ack-p99.sh [--broker-cpus LIST] [--client-cpus LIST] [--runs N]
#                   [--duration SECS] [--data-dir DIR] [--no-build]
#
#   --broker-cpus LIST  `felix serve --cores` (default 0,1)
#   --client-cpus LIST  run felix-bench under `taskset -c LIST` (default:
#                       unpinned, sharing the broker's CPUs)
#   --runs N            open-loop runs at half the peak (default 3)
#   --duration SECS     measured seconds of each run (default 10)
#   --data-dir DIR      parent of the broker's data directory (default: a
#                       temporary directory; put it on the disk to measure)
#   --no-build          use target/release as it is
#
# Ports 7460 (clients) and 7461 (metrics) on 127.0.0.1. Everything it starts
# it stops. Exit status 0 when every half-load run had p99 under 2 ms.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1

BROKER_CPUS=0,1
CLIENT_CPUS=""
RUNS=3
DURATION=10
PARENT=""
BUILD=1
usage() { sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --broker-cpus|--client-cpus|--runs|--duration|--data-dir)
      [ $# -ge 2 ] || { echo "$1 needs a value" >&2; exit 2; } ;;
  esac
  case "$1" in
    --broker-cpus) BROKER_CPUS=$2; shift 2 ;;
    --client-cpus) CLIENT_CPUS=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --duration) DURATION=$2; shift 2 ;;
    --data-dir) PARENT=$2; shift 2 ;;
    --no-build) BUILD=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
for v in "$RUNS" "$DURATION"; do
  case "$v" in ''|*[!0-9]*|0) echo "--runs and --duration take a whole number above 0 (got '$v')" >&2; exit 2 ;; esac
done
command -v python3 > /dev/null || { echo "needs python3 (to read felix-bench's JSON)" >&2; exit 2; }
if [ -n "$CLIENT_CPUS" ]; then
  command -v taskset > /dev/null || { echo "--client-cpus needs taskset (util-linux)" >&2; exit 2; }
fi

if [ "$BUILD" = 1 ]; then
  cargo build --release -p felix-cli -p felix-bench || exit 1
fi
FELIX=target/release/felix
BENCH=target/release/felix-bench
[ -x "$FELIX" ] && [ -x "$BENCH" ] || { echo "no release build in target/release (drop --no-build)" >&2; exit 1; }

W=$(mktemp -d "${PARENT:-${TMPDIR:-/tmp}}/felix-ack-p99.XXXXXX") || exit 1
BPID=""
cleanup() {
  if [ -n "$BPID" ]; then kill -TERM "$BPID" 2> /dev/null; wait "$BPID" 2> /dev/null; fi
  rm -rf "$W"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

FELIX_METRICS_LISTEN=127.0.0.1:7461 "$FELIX" serve --data-dir "$W/data" \
  --listen 127.0.0.1:7460 --cores "$BROKER_CPUS" > "$W/broker.log" 2>&1 &
BPID=$!
for _ in $(seq 100); do
  grep -q "listening on" "$W/broker.log" && break
  kill -0 "$BPID" 2> /dev/null || { cat "$W/broker.log" >&2; exit 1; }
  sleep 0.1
done
grep -q "listening on" "$W/broker.log" || { echo "the broker did not start" >&2; exit 1; }

bench() {  # bench JSON-FILE EXTRA-ARGS...: one publish run against the broker
  local json=$1; shift
  local pin=()
  [ -n "$CLIENT_CPUS" ] && pin=(taskset -c "$CLIENT_CPUS")
  "${pin[@]}" "$BENCH" publish --broker 127.0.0.1:7460 --broker-metrics 127.0.0.1:7461 \
    --producers 4 --shards 2 --batch 100 --record-size 100 \
    --duration "$DURATION" --warmup 2 --json "$json" "$@" > "$W/bench.out" 2>&1
}
field() {  # field JSON-FILE: one line of the figures this script reports
  python3 - "$1" << 'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
lat, b, m = d.get("latency") or {}, d.get("broker_publish_latency") or {}, d["machine"]
def us(v):
    return "-" if v is None else (f"{v / 1000:.2f} ms" if v >= 1000 else f"{v:.0f} us")
cpus = lambda v: "-" if v is None else f"{v:.2f}"
print(f"{d['records_per_sec']:>12,.0f} rec/s  ack p50 {us(lat.get('p50_us'))}  p99 {us(lat.get('p99_us'))}"
      f"  broker p99 <= {us(b.get('p99_at_most_us'))}  busy {(m.get('cpu_busy') or 0) * 100:.0f}%"
      f" stolen {(m.get('cpu_steal') or 0) * 100:.0f}%  broker {cpus(m.get('broker_cpus'))} CPUs"
      f" client {cpus(m.get('client_cpus'))}")
EOF
}

echo "broker: felix serve --cores $BROKER_CPUS; client on ${CLIENT_CPUS:-any CPU}; $DURATION s a run"
bench "$W/peak.json" --inflight 8 || { cat "$W/bench.out" >&2; exit 1; }
peak=$(python3 -c 'import json,sys; print(int(json.load(open(sys.argv[1]))["records_per_sec"]))' "$W/peak.json")
echo "peak (closed loop)   $(field "$W/peak.json")"
half=$(( peak / 2 ))
met=0
for i in $(seq "$RUNS"); do
  bench "$W/half-$i.json" --inflight 64 --rate "$half" || { cat "$W/bench.out" >&2; exit 1; }
  echo "half ($half/s) #$i $(field "$W/half-$i.json")"
  p99=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["latency"]["p99_us"])' "$W/half-$i.json")
  python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) < 2000 else 1)' "$p99" && met=$(( met + 1 ))
done
echo "p99 under 2 ms in $met of $RUNS runs at half the peak"
[ "$met" = "$RUNS" ]
