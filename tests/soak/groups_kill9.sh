#!/usr/bin/env bash
# Consumer-group kill -9 soak: publish 1, 2, 3, ... while a group consumes
# them with the felix CLI (poll, print, ack), kill -9 the broker at a random
# moment, restart it, and go on. Checks, after every restart, that the
# group's durable position never moved backwards and that nothing below it
# is handed out again (everything below the position is finished), and at
# the end that every record the log holds was delivered at least once and
# the group finished them all. Repeats ROUNDS times (default 20), publishing
# up to K records a round (default 1,000,000).
#
#   cargo build --release -p felix-cli && tests/soak/groups_kill9.sh [ROUNDS] [K]
set -u
cd "$(dirname "$0")/../.." || exit 1
F=${FELIX:-target/release/felix}
PORT=${PORT:-7612}
W=$(mktemp -d /tmp/felix-groups-kill9.XXXXXX)
BPID=
# On exit: the broker and any publisher or consumer still running (a
# consumer left behind would go on taking records from the next run's group).
trap 'kill $(jobs -p) 2>/dev/null; if [ -n "$BPID" ]; then kill -9 "$BPID" 2>/dev/null; fi; [ -n "${KEEP:-}" ] || rm -rf "$W"' EXIT

. tests/soak/lib.sh

position() {
  felix group describe t/n/q --shard 0 --group g 2>/dev/null | awk '$1 == "position" { print $2 }'
}

rounds=${1:-20}
k=${2:-1000000}
start
felix stream create t/n/q --shards 1 > /dev/null || exit 1
felix group create t/n/q --shard 0 --group g --to earliest > /dev/null || exit 1
: > "$W/all.jsonl"
last=0
next=1
for round in $(seq 1 "$rounds"); do
  # Publish the next K numbers while the group consumes, until the kill.
  # Background jobs run the binary itself (not the `felix` function), so
  # that $! is the process to kill, not a subshell that would leave it
  # running.
  seq "$next" $((next + k - 1)) | "$F" --broker "127.0.0.1:$PORT" publish t/n/q --shard 0 \
    > /dev/null 2>&1 &
  pub=$!
  "$F" --broker "127.0.0.1:$PORT" consume t/n/q --group g --batch 200 --wait-ms 200 --follow \
    --format json > "$W/round.jsonl" 2> "$W/consume.err" &
  cons=$!
  sleep "$(python3 -c 'import random; print(random.uniform(0.3, 1.5))')"
  kill -9 "$BPID"; wait "$BPID" 2>/dev/null
  # The publisher gives up; the consumer (--follow) would keep retrying.
  kill "$cons" 2>/dev/null
  wait "$pub" "$cons" 2>/dev/null
  # Whole lines only: the kill may cut the consumer's last line short.
  awk '/}$/' "$W/round.jsonl" >> "$W/all.jsonl"
  [ -n "${KEEP:-}" ] && cp "$W/round.jsonl" "$W/round-$round.jsonl" && cp "$W/consume.err" "$W/consume-$round.err"
  start
  pos=$(position)
  end=$(felix group describe t/n/q --shard 0 --group g 2>/dev/null | awk '$1 == "end_offset" { print $2 }')
  if [ -z "$pos" ] || [ "$pos" -lt "$last" ]; then
    echo "round $round: position ${pos:-?} after the restart, was $last: soak FAILED"; exit 1
  fi
  # The first poll after the restart starts at the position: nothing below
  # it comes back.
  felix consume t/n/q --group g --batch 200 --count 200 --wait-ms 200 --format json \
    > "$W/first.jsonl" 2>/dev/null
  below=$(python3 -c '
import json, sys
pos = int(sys.argv[2])
low = [json.loads(l)["offset"] for l in open(sys.argv[1]) if json.loads(l)["offset"] < pos]
print(low[0] if low else "")' "$W/first.jsonl" "$pos")
  cat "$W/first.jsonl" >> "$W/all.jsonl"
  if [ -n "$below" ]; then
    echo "round $round: offset $below handed out again below the position $pos: soak FAILED"; exit 1
  fi
  echo "round $round: log end $end, group position $pos after the restart ($(wc -l < "$W/round.jsonl") delivered before the kill)"
  last=$pos
  next=$((end + 1))
done
# Finish without kills: everything left goes out once more.
felix consume t/n/q --group g --batch 500 --wait-ms 500 --format json >> "$W/all.jsonl" 2>/dev/null
pos=$(position)
felix read t/n/q --shard 0 --from earliest --count 1000000000 > "$W/log.txt"
python3 - "$W/all.jsonl" "$W/log.txt" "$pos" <<'PY' || exit 1
import json, sys
path, log, pos = sys.argv[1], sys.argv[2], int(sys.argv[3])
held = [int(l) for l in open(log)]
if held != list(range(1, len(held) + 1)):
    print("soak FAILED: the log does not hold 1, 2, 3, ... in order")
    sys.exit(1)
seen = {}
for n, line in enumerate(open(path), 1):
    try:
        r = json.loads(line)
    except ValueError:
        print(f"soak FAILED: line {n} of the deliveries is not a record: {line[:200]!r}")
        sys.exit(1)
    seen[int(r["payload"])] = seen.get(int(r["payload"]), 0) + 1
missing = [p for p in held if p not in seen]
dups = sum(c - 1 for c in seen.values())
print(f"log holds {len(held)}; delivered {sum(seen.values())} ({dups} redeliveries); final position {pos}")
if missing or pos != len(held):
    print(f"soak FAILED: {len(missing)} never delivered (first {missing[:5]}), position {pos} of {len(held)}")
    sys.exit(1)
PY
echo "groups soak passed: $rounds kills"
