#!/usr/bin/env bash
# kill -9 soak: publish a numbered sequence with the felix CLI, kill -9 the
# broker at a random moment, restart it, and check that the shard holds
# 1, 2, 3, ... in order with no gap or duplicate, and at least every record
# the CLI saw acknowledged. Repeats ROUNDS times (default 20).
#
#   cargo build --release -p felix-cli && tests/soak/kill9.sh [ROUNDS]
set -u
cd "$(dirname "$0")/../.." || exit 1
F=${FELIX:-target/release/felix}
PORT=${PORT:-7611}
W=$(mktemp -d /tmp/felix-kill9.XXXXXX)
BPID=
trap 'if [ -n "$BPID" ]; then kill -9 "$BPID" 2>/dev/null; fi; rm -rf "$W"' EXIT

. tests/soak/lib.sh

start
"$F" --broker "127.0.0.1:$PORT" stream create t/n/s --shards 1 > /dev/null || exit 1
next=1
total=0
rounds=${1:-20}
for round in $(seq 1 "$rounds"); do
  seq "$next" $((next + 5000000)) \
    | "$F" --broker "127.0.0.1:$PORT" publish t/n/s --shard 0 > "$W/pub.out" 2> "$W/pub.err" &
  pub=$!
  sleep "$(python3 -c 'import random; print(random.uniform(0.2, 1.5))')"
  kill -9 "$BPID"; wait "$BPID" 2>/dev/null
  wait "$pub" 2>/dev/null
  # The CLI says how many records were acknowledged, error or not.
  acked=$(grep -hoE "published [0-9]+" "$W/pub.err" "$W/pub.out" | grep -oE "[0-9]+" | head -1)
  start
  "$F" --broker "127.0.0.1:$PORT" read t/n/s --shard 0 --from earliest --count 100000000 > "$W/read.txt"
  total=$(wc -l < "$W/read.txt")
  bad=$(awk 'NR != $1 { print "line " NR " holds " $1; exit }' "$W/read.txt")
  need=$((next - 1 + ${acked:-0}))
  echo "round $round: $acked acknowledged this round; the log holds $total (at least $need) ${bad:+BAD: $bad}"
  if [ -n "$bad" ] || [ "$total" -lt "$need" ]; then echo "soak FAILED"; exit 1; fi
  next=$((total + 1))
done
echo "soak passed: $rounds kills, $total records in order"
