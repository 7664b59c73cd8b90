#!/usr/bin/env python3
"""Render perf/RESULTS.md from a perf/compare.sh results directory.

usage: render.py RESULTS_DIR > perf/RESULTS.md
"""
import json
import os
import sys

D = sys.argv[1]

CONFIGS = [
    ("felix", "Felix (durable acks)"),
    ("redis-durable", "Redis (appendfsync always)"),
    ("nats-durable", "NATS (sync_interval always)"),
    ("redis-default", "Redis (defaults)"),
    ("nats-default", "NATS (defaults)"),
]
DURABLE_PEERS = ["redis-durable", "nats-durable"]
DEFAULT_PEERS = ["redis-default", "nats-default"]


def load(name):
    p = os.path.join(D, name + ".json")
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_text(name):
    try:
        with open(os.path.join(D, name)) as f:
            return f.read()
    except OSError:
        return ""


def machine():
    m = {}
    for line in read_text("machine.txt").splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            m[k] = v
    return m


def fmt_int(x):
    return "{:,}".format(int(round(x)))


def fmt_us(us):
    if us is None:
        return "–"
    if us >= 1e6:
        return "%.2f s" % (us / 1e6)
    if us >= 1e3:
        return "%.2f ms" % (us / 1e3)
    return "%.0f µs" % us


def status(doc):
    if doc is None:
        return "not run"
    if not doc.get("ok"):
        err = doc.get("first_error") or "; ".join(
            c["name"] + ": " + c["detail"] for c in doc.get("checks", []) if c.get("ok") is False
        )
        return "FAILED (%s)" % (err or "see log")
    return ""


def cell_rate(doc):
    if doc is None:
        return "–"
    s = fmt_int(doc["records_per_sec"])
    if doc.get("stop_reason") == "drained":
        s += " ᵈ"
    if not doc.get("ok"):
        s += " ⚠"
    return s


def row(label, fn, prefix_workload):
    cells = []
    for key, _ in CONFIGS:
        cells.append(fn(load("%s-%s" % (key, prefix_workload))))
    return "| %s | %s |" % (label, " | ".join(cells))


def ratio(a, b):
    if not a or not b or b["records_per_sec"] <= 0 or a["records_per_sec"] <= 0:
        return "–"
    return "%.2f×" % (a["records_per_sec"] / b["records_per_sec"])


def fio(name):
    try:
        with open(os.path.join(D, name)) as f:
            j = json.load(f)
        w = j["jobs"][0]["write"]
        sync = j["jobs"][0].get("sync", {})
        lat = sync.get("lat_ns", {}).get("percentile", {}) if sync else {}
        return {
            "mbps": w["bw_bytes"] / 1e6,
            "iops": w["iops"],
            "sync_p50_us": lat.get("50.000000", 0) / 1e3 if lat else None,
            "sync_p99_us": lat.get("99.000000", 0) / 1e3 if lat else None,
        }
    except (OSError, ValueError, KeyError, IndexError):
        return None


def iperf():
    try:
        with open(os.path.join(D, "iperf3.json")) as f:
            j = json.load(f)
        return j["end"]["sum_received"]["bits_per_second"] / 1e9
    except (OSError, ValueError, KeyError):
        return None


m = machine()
out = []
w = out.append
w("# Felix vs Redis Streams vs NATS JetStream — measured results")
w("")
w("Written by `perf/compare.sh` (do not edit by hand; rerun it). Raw JSON of every run:")
w("`perf/results/latest/` (not committed). How to read these numbers and what each")
w("workload does: `docs/benchmarking.md`.")
w("")
w("Every figure below comes from the same harness (`felix-bench`) driving each broker with")
w("the same workload shape, one broker at a time, on loopback, on this machine: %s CPU(s)," % m.get("cpus", "?"))
w("so **the client and the broker share the same cores** — treat absolute numbers as this")
w("machine's, and the ratios as the comparison. Records are 100-byte payloads; streams have 2")
w("shards (Redis: 2 stream keys, NATS: 2 JetStream streams). %s s warm-up, then %s s measured." % (m.get("warmup", "?"), m.get("duration", "?")))
if m.get("load_start"):
    w("Load average (1/5/15 min) when the run began: %s; when it ended: %s. A load above the" % (m.get("load_start"), m.get("load_end", "?")))
    w("CPU count means other work shared the machine and the figures are low and noisy.")
w("")
w("## Results")
w("")
w("| workload | " + " | ".join(label for _, label in CONFIGS) + " |")
w("|---|" + "---:|" * len(CONFIGS))
w(row("publish, records/s", cell_rate, "publish"))
w(row("publish, ack latency p50 / p99", lambda d: "–" if d is None else "%s / %s" % (fmt_us(d["latency"]["p50_us"]), fmt_us(d["latency"]["p99_us"])), "publish"))
w(row("read (replay), records/s", cell_rate, "read"))
w(row("queue poll + ack, records/s", cell_rate, "queue"))
w(row("e2e offered rate (½ min(publish, queue) peak), records/s", lambda d: "–" if d is None else fmt_int(d.get("offered_rate") or 0), "e2e"))
w(row("e2e publish→delivery p50", lambda d: "–" if d is None else fmt_us(d["latency"]["p50_us"]), "e2e"))
w(row("e2e publish→delivery p99", lambda d: "–" if d is None else fmt_us(d["latency"]["p99_us"]), "e2e"))
w(row("e2e publish→delivery p99.9 / max", lambda d: "–" if d is None else "%s / %s" % (fmt_us(d["latency"]["p999_us"]), fmt_us(d["latency"]["max_us"])), "e2e"))
w("")
q = load("felix-queued-publish")
if q:
    w("Felix with queued acks (`--ack queued`, acknowledged before fdatasync): **%s records/s**, ack p99 %s." % (fmt_int(q["records_per_sec"]), fmt_us(q["latency"]["p99_us"])))
    w("")
w("ᵈ the backlog ran out before the measurement time did (rate over the time it took). ⚠ the run reported errors or failed a check (see Run status).")
w("")

w("## Ratios (Felix ÷ peer, throughput)")
w("")
w("| workload | " + " | ".join(label for k, label in CONFIGS if k != "felix") + " |")
w("|---|" + "---:|" * (len(CONFIGS) - 1))
for wl, label in [("publish", "publish"), ("read", "read"), ("queue", "queue poll + ack")]:
    f = load("felix-" + wl)
    w("| %s | %s |" % (label, " | ".join(ratio(f, load("%s-%s" % (k, wl))) for k, _ in CONFIGS if k != "felix")))
w("")
w("Durable columns compare like with like (every acknowledged record is on disk: Felix")
w("acknowledges after fdatasync; Redis fsyncs the AOF before replying; NATS syncs every write).")
w("The default columns are the peers' out-of-the-box settings, which acknowledge before the")
w("data is on disk (Redis: no AOF / everysec; NATS: fsync every 2 minutes).")
w("")

w("## Felix against its targets")
w("")
fp = load("felix-publish")
fq = load("felix-queue")
fe = load("felix-e2e")
def met(ok):
    return "met" if ok else "**not met**"
w("| target | measured | |")
w("|---|---:|---|")
if fp:
    w("| durable publish ≥ 1,000,000 records/s of 100 B | %s | %s |" % (fmt_int(fp["records_per_sec"]), met(fp["records_per_sec"] >= 1e6)))
if fq:
    w("| queue poll + ack ≥ 500,000 records/s | %s | %s |" % (fmt_int(fq["records_per_sec"]), met(fq["records_per_sec"] >= 5e5)))
if fe:
    w("| e2e p99 ≤ 2 ms at 50%% of peak (%s records/s offered) | %s | %s |" % (fmt_int(fe.get("offered_rate") or 0), fmt_us(fe["latency"]["p99_us"]), met(fe["latency"]["p99_us"] <= 2000)))
w("")

w("## Run status")
w("")
any_bad = False
for key, label in CONFIGS + [("felix-queued", "Felix (queued acks)")]:
    for wl in ["publish", "read", "queue", "e2e"]:
        name = "%s-%s" % (key, wl)
        doc = load(name)
        if doc is None and not os.path.exists(os.path.join(D, name + ".log")):
            continue
        st = status(doc)
        if doc is None:
            log = read_text(name + ".log").strip().splitlines()
            st = "FAILED: " + (log[-1] if log else "no output")
        if st:
            any_bad = True
            w("- `%s`: %s" % (name, st))
skipped = read_text("skipped.txt").strip()
for line in skipped.splitlines():
    any_bad = True
    w("- `%s`" % line)
if not any_bad:
    w("Every run completed and every count check passed (records stored = acknowledged,")
    w("records read = published, records left in the queue = backlog − acknowledged).")
w("")

w("## Machine and versions")
w("")
f1 = fio("fio-1m.json")
f4 = fio("fio-4k.json")
lo = iperf()
w("| | |")
w("|---|---|")
for k, label in [("date", "date"), ("cpu_model", "CPU"), ("cpus", "CPUs"), ("memory", "memory"),
                 ("kernel", "kernel"), ("filesystem", "data filesystem"), ("rustc", "rustc"),
                 ("felix", "felix (git)"), ("redis", "redis-server"), ("nats", "nats-server"),
                 ("fio", "fio"), ("iperf3", "iperf3"), ("elapsed", "compare.sh run time")]:
    if m.get(k):
        w("| %s | %s |" % (label, m[k]))
if f1:
    w("| disk: 1 MiB O_DIRECT sequential writes, fdatasync each (fio) | %.0f MB/s |" % f1["mbps"])
if f4:
    extra = ""
    if f4.get("sync_p50_us") is not None:
        extra = ", fdatasync p50 %s / p99 %s" % (fmt_us(f4["sync_p50_us"]), fmt_us(f4["sync_p99_us"]))
    w("| disk: 4 KiB O_DIRECT writes, fdatasync each (fio) | %s writes/s%s |" % (fmt_int(f4["iops"]), extra))
if lo:
    w("| loopback TCP (iperf3, 1 stream) | %.1f Gbit/s |" % lo)
w("")
w("The disk row is the ceiling for durable publishing: 100-byte records at the 1 MiB")
w("fdatasync rate would be about %s records/s of payload." % (fmt_int(f1["mbps"] * 1e6 / 100) if f1 else "?"))
w("")

w("## Commands")
w("")
w("```")
w(read_text("commands.txt").rstrip())
w("```")
w("")
w("NATS configuration files used are in `perf/results/latest/nats-*.conf`; Redis was started")
w("with `redis-server --appendonly yes --appendfsync always` (durable) or with no options (defaults).")
print("\n".join(out))
