# Shared by the kill -9 soaks, sourced once F (the felix binary), PORT and W
# (the run's directory) are set: start a broker on $W/data (its pid in
# BPID), and talk to it.

felix() { "$F" --broker "127.0.0.1:$PORT" "$@"; }

start() {
  FELIX_METRICS_LISTEN='' "$F" serve --data-dir "$W/data" --listen "127.0.0.1:$PORT" \
    --cores 2 > "$W/broker.log" 2>&1 &
  BPID=$!
  for _ in $(seq 1 100); do
    grep -q "listening" "$W/broker.log" && return
    sleep 0.1
  done
  echo "broker did not start:"; cat "$W/broker.log"; exit 1
}
