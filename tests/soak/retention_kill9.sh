#!/usr/bin/env bash
# Retention kill -9 soak: a shard with small segments and size retention is
# published to (1, 2, 3, ... padded to ~120 bytes) while a consumer group
# that falls behind and a follow reader work through it and retention
# deletes segments under both; the broker is killed with kill -9 at a random
# moment and restarted, ROUNDS times (default 10).
#
# Checks:
# * the broker opens its data after every kill;
# * every record a reader or the group got is intact: payload N at offset N-1
#   (the publisher restarts from the log's end, so the log stays 1, 2, 3, ...);
# * a reader's offsets only go up between kills;
# * holes in the group's deliveries are accounted for: every offset below
#   the group's final position was delivered or lies in the `skipped_before`
#   run of a delivered record (retention removed it before the group got
#   to it), across restarts too: the position entry keeps the count for
#   the record at the position;
# * the consumer and the reader report no error but a lost connection (or a
#   reader falling behind retention, which it is told about).
#
#   cargo build --release -p felix-cli && tests/soak/retention_kill9.sh [ROUNDS]
set -u
cd "$(dirname "$0")/../.." || exit 1
F=${FELIX:-target/release/felix}
PORT=${PORT:-7613}
W=$(mktemp -d /tmp/felix-retention-kill9.XXXXXX)
BPID=
trap 'kill $(jobs -p) 2>/dev/null; if [ -n "$BPID" ]; then kill -9 "$BPID" 2>/dev/null; fi; [ -n "${KEEP:-}" ] || rm -rf "$W"' EXIT
felix() { "$F" --broker "127.0.0.1:$PORT" "$@"; }

cat > "$W/felix.toml" <<EOF
[server]
listen = "127.0.0.1:$PORT"
metrics_listen = ""
[storage]
data_dir = "$W/data"
segment_bytes = 262144
retention_check_ms = 50
EOF

LOGN=0
start() {
  LOGN=$((LOGN + 1))
  "$F" serve --config "$W/felix.toml" --cores 2 > "$W/broker-$LOGN.log" 2>&1 &
  BPID=$!
  for _ in $(seq 1 100); do
    grep -q "listening" "$W/broker-$LOGN.log" && return
    sleep 0.1
  done
  echo "broker did not start:"; cat "$W/broker-$LOGN.log"; exit 1
}

end_offset() {
  felix group describe t/n/r --shard 0 --group g 2>/dev/null | awk '$1 == "end_offset" { print $2 }'
}

rounds=${1:-10}
start
felix stream create t/n/r --shards 1 --retention-bytes 1048576 > /dev/null || exit 1
felix group create t/n/r --shard 0 --group g --to earliest > /dev/null || exit 1
: > "$W/group.jsonl"
: > "$W/errors.txt"
next=1
for round in $(seq 1 "$rounds"); do
  # Padded numbers: about 120 bytes a record, so 1 MiB of retention holds
  # some 8,000 and the segments roll every ~2,000.
  seq "$next" $((next + 2000000)) | awk '{ printf "%d-%0110d\n", $1, 0 }' \
    | "$F" --broker "127.0.0.1:$PORT" publish t/n/r --shard 0 > /dev/null 2> "$W/publish-$round.err" &
  pub=$!
  "$F" --broker "127.0.0.1:$PORT" read t/n/r --shard 0 --from earliest --follow --format json \
    > "$W/read-$round.jsonl" 2> "$W/read-$round.err" &
  rd=$!
  # The group starts late each round, so retention passes it.
  sleep 0.2
  "$F" --broker "127.0.0.1:$PORT" consume t/n/r --group g --batch 100 --wait-ms 200 --follow \
    --format json > "$W/group-$round.jsonl" 2> "$W/group-$round.err" &
  cons=$!
  sleep "$(python3 -c 'import random; print(random.uniform(0.5, 2.0))')"
  kill -9 "$BPID"; wait "$BPID" 2>/dev/null
  kill "$cons" "$rd" 2>/dev/null
  wait "$pub" "$cons" "$rd" 2>/dev/null
  awk '/}$/' "$W/group-$round.jsonl" >> "$W/group.jsonl"
  for e in "$W/read-$round.err" "$W/group-$round.err" "$W/publish-$round.err"; do
    # A lost connection is the kill's doing, and a consumer stopped by
    # SIGTERM says so and names what it printed but could not ack; anything
    # else is not.
    grep -v -E "stopping after this batch|printed records? (was|were) not acknowledged|connection to the broker was lost|i/o error: .*(refused|reset|broken pipe)|timed out waiting for the broker|fell behind retention|^published [0-9]+ records? before the error|^no input record after record [0-9]+ was sent|refused after a reconnect|^(consumed|read) [0-9]+ records?|^$" "$e" \
      | sed "s|^|$(basename "$e"): |" >> "$W/errors.txt"
  done
  start
  end=$(end_offset)
  [ -n "$end" ] || { echo "round $round: no end offset after the restart: soak FAILED"; exit 1; }
  echo "round $round: log end $end; group got $(wc -l < "$W/group-$round.jsonl"), reader $(wc -l < "$W/read-$round.jsonl") before the kill"
  next=$((end + 1))
done
# Drain the group without kills.
felix consume t/n/r --group g --batch 500 --wait-ms 500 --format json >> "$W/group.jsonl" 2> "$W/drain.err"
grep -v -E "^consumed [0-9]+ records" "$W/drain.err" >> "$W/errors.txt"
felix group describe t/n/r --shard 0 --group g > "$W/describe.txt" 2>&1
pos=$(awk '$1 == "position" { print $2 }' "$W/describe.txt")
start_off=$(awk '$1 == "start_offset" { print $2 }' "$W/describe.txt")
end=$(awk '$1 == "end_offset" { print $2 }' "$W/describe.txt")
if [ -z "$pos" ] || [ "$pos" != "$end" ]; then
  echo "soak FAILED: the drained group stands at ${pos:-?}, not at the log's end ${end:-?}"; exit 1
fi
# The broker itself: nothing stopped, nothing failed to open or delete.
if grep -h -E "ERROR|shard stopped|panicked" "$W"/broker-*.log | head -5 | grep .; then
  echo "soak FAILED: the broker logged the errors above"; exit 1
fi
if [ -s "$W/errors.txt" ]; then
  echo "soak FAILED: clients reported errors:"; head -20 "$W/errors.txt"; exit 1
fi
python3 - "$W" "$rounds" "$pos" "${start_off:-0}" <<'PY' || exit 1
import json, re, sys
w, rounds, pos, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def records(path):
    for n, line in enumerate(open(path), 1):
        if not line.endswith("}\n"):
            continue  # cut short by the kill
        yield n, json.loads(line)
def intact(r, where):
    want = f"{r['offset'] + 1}-{0:0110d}"
    if r["payload"] != want:
        print(f"soak FAILED: {where}: offset {r['offset']} holds {r['payload'][:40]!r}, not {want[:40]!r}...")
        sys.exit(1)
read_total = 0
jumps = 0
for k in range(1, rounds + 1):
    # The reader says when retention removed records before it read them:
    # "... from=F start=S". Those are the only gaps it may have.
    told = set()
    for line in open(f"{w}/read-{k}.err"):
        m = re.search(r"from\S*?=\S*?(\d+).*start\S*?=\S*?(\d+)", re.sub(r"\x1b\[[0-9;]*m", "", line))
        if m and "fell behind retention" in line:
            told.add((int(m.group(1)), int(m.group(2))))
    last = -1
    for n, r in records(f"{w}/read-{k}.jsonl"):
        intact(r, f"reader, round {k}, line {n}")
        o = r["offset"]
        if last >= 0 and o != last + 1:
            if (last + 1, o) not in told:
                print(f"soak FAILED: reader round {k}: offset {o} after {last}, and no "
                      f"warning that {last + 1}..{o} fell behind retention")
                sys.exit(1)
            jumps += 1
        last = o
        read_total += 1
covered = set()
distinct = set()
delivered = 0
for n, r in records(f"{w}/group.jsonl"):
    intact(r, f"group, line {n}")
    o = r["offset"]
    covered.add(o)
    distinct.add(o)
    covered.update(range(o - r.get("skipped_before", 0), o))
    delivered += 1
holes = [o for o in range(0, pos) if o not in covered]
print(f"reader got {read_total} records intact and in order ({jumps} jumps over retention, "
      f"each announced); group delivered {delivered} "
      f"({len(distinct)} distinct) and reported {len(covered - distinct)} skipped by retention; position {pos}, log start {start}")
if start == 0 or read_total == 0 or delivered == 0 or not (covered - distinct):
    print("soak FAILED: nothing to check: retention never removed anything the group "
          "had not reached, or nothing was read or delivered")
    sys.exit(1)
if holes:
    print(f"soak FAILED: {len(holes)} offsets below the position were neither delivered nor "
          f"reported skipped (first {holes[:10]})")
    sys.exit(1)
PY
echo "retention soak passed: $rounds kills"
