#!/usr/bin/env bash
# Consumer-group kill -9 soak across shards: one publisher per shard writes
# s<shard>-1, s<shard>-2, ... while `felix consume --all-shards` (the
# client's ShardedGroup) consumes the group on every shard; the broker is
# killed with -9 at a random moment, restarted, and the run goes on. Checks,
# after every restart, that no shard's durable position moved backwards and
# that nothing below a shard's position is handed out again, and at the end
# that every record the log holds was delivered at least once and every
# shard's group finished its log. Repeats ROUNDS times (default 10) with
# SHARDS shards (default 3), publishing up to K records a shard a round
# (default 300,000).
#
#   cargo build --release -p felix-cli && tests/soak/groups_sharded_kill9.sh [ROUNDS] [SHARDS] [K]
# On exit: the broker and any publisher or consumer still running.

set -u
cd "$(dirname "$0")/../.." || exit 1
F=${FELIX:-target/release/felix}
PORT=${PORT:-7614}
W=$(mktemp -d /tmp/felix-groups-sharded-kill9.XXXXXX)
BPID=
trap 'kill $(jobs -p) 2>/dev/null; if [ -n "$BPID" ]; then kill -9 "$BPID" 2>/dev/null; fi; [ -n "${KEEP:-}" ] || rm -rf "$W"' EXIT

. tests/soak/lib.sh

# "position end" of each shard's group, one line per shard.
positions() {
  felix group describe t/n/q --group g --all-shards 2>/dev/null |
    awk 'NR > 1 && $1 != "all" { print $2, $3 }'
}

rounds=${1:-10}
shards=${2:-3}
k=${3:-300000}
start
felix stream create t/n/q --shards "$shards" > /dev/null || exit 1
felix group create t/n/q --group g --all-shards --to earliest > /dev/null || exit 1
: > "$W/all.jsonl"
declare -a last next
for s in $(seq 0 $((shards - 1))); do last[$s]=0; next[$s]=1; done
for round in $(seq 1 "$rounds"); do
  pubs=()
  for s in $(seq 0 $((shards - 1))); do
    seq "${next[$s]}" $((next[s] + k - 1)) | sed "s/^/s$s-/" |
      "$F" --broker "127.0.0.1:$PORT" publish t/n/q --shard "$s" > /dev/null 2>&1 &
    pubs+=($!)
  done
  "$F" --broker "127.0.0.1:$PORT" consume t/n/q --group g --all-shards --batch 200 \
    --wait-ms 200 --follow --format json > "$W/round.jsonl" 2> "$W/consume.err" &
  cons=$!
  sleep "$(python3 -c 'import random; print(random.uniform(0.3, 1.5))')"
  kill -9 "$BPID"; wait "$BPID" 2>/dev/null
  kill "$cons" 2>/dev/null
  wait "${pubs[@]}" "$cons" 2>/dev/null
  # Whole lines only: the kill may cut the consumer's last line short.
  awk '/}$/' "$W/round.jsonl" >> "$W/all.jsonl"
  [ -n "${KEEP:-}" ] && cp "$W/round.jsonl" "$W/round-$round.jsonl" && cp "$W/consume.err" "$W/consume-$round.err"
  start
  mapfile -t rows < <(positions)
  if [ "${#rows[@]}" -ne "$shards" ]; then
    echo "round $round: no group description after the restart: soak FAILED"; exit 1
  fi
  poss=()
  for s in $(seq 0 $((shards - 1))); do
    read -r pos end <<< "${rows[$s]}"
    if [ "$pos" -lt "${last[$s]}" ]; then
      echo "round $round: shard $s position $pos after the restart, was ${last[$s]}: soak FAILED"; exit 1
    fi
    last[$s]=$pos
    # Each shard's log holds s<shard>-1 .. s<shard>-end: publish on from there.
    next[$s]=$((end + 1))
    poss+=("$pos")
  done
  # The first polls after the restart start at each shard's position:
  # nothing below it comes back.
  felix consume t/n/q --group g --all-shards --batch 200 --count 600 --wait-ms 200 \
    --format json > "$W/first.jsonl" 2>/dev/null
  below=$(python3 -c '
import json, sys
pos = [int(p) for p in sys.argv[2:]]
low = [(r["shard"], r["offset"]) for r in map(json.loads, open(sys.argv[1])) if r["offset"] < pos[r["shard"]]]
print(low[0] if low else "")' "$W/first.jsonl" "${poss[@]}")
  cat "$W/first.jsonl" >> "$W/all.jsonl"
  if [ -n "$below" ]; then
    echo "round $round: (shard, offset) $below handed out again below the position: soak FAILED"; exit 1
  fi
  echo "round $round: positions ${poss[*]} after the restart ($(wc -l < "$W/round.jsonl") delivered before the kill)"
done
# Finish without kills: everything left goes out once more.
felix consume t/n/q --group g --all-shards --batch 500 --wait-ms 1000 --format json \
  >> "$W/all.jsonl" 2>/dev/null
mapfile -t rows < <(positions)
for s in $(seq 0 $((shards - 1))); do
  felix read t/n/q --shard "$s" --from earliest --count 1000000000 > "$W/log-$s.txt"
done
python3 - "$W" "$shards" "${rows[@]}" <<'PY' || exit 1
import json, sys
w, shards, rows = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
seen = {}
for n, line in enumerate(open(f"{w}/all.jsonl"), 1):
    try:
        r = json.loads(line)
    except ValueError:
        print(f"soak FAILED: line {n} of the deliveries is not a record: {line[:200]!r}")
        sys.exit(1)
    seen[r["payload"]] = seen.get(r["payload"], 0) + 1
total = 0
for s in range(shards):
    held = [l.rstrip("\n") for l in open(f"{w}/log-{s}.txt")]
    if held != [f"s{s}-{i}" for i in range(1, len(held) + 1)]:
        print(f"soak FAILED: shard {s}'s log does not hold s{s}-1, s{s}-2, ... in order")
        sys.exit(1)
    pos, end = map(int, rows[s].split())
    missing = [p for p in held if p not in seen]
    if missing or pos != len(held) or end != len(held):
        print(f"soak FAILED: shard {s}: {len(missing)} never delivered (first {missing[:5]}), "
              f"position {pos}, end {end}, log {len(held)}")
        sys.exit(1)
    total += len(held)
dups = sum(c - 1 for c in seen.values())
print(f"logs hold {total} over {shards} shards; delivered {sum(seen.values())} ({dups} redeliveries); every group finished")
PY
echo "sharded groups soak passed: $rounds kills"
