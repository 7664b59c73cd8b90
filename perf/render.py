#!/usr/bin/env python3
"""Render perf/RESULTS.md from a perf/compare.sh results directory.

usage: render.py RESULTS_DIR > perf/RESULTS.md
"""
import json
import os
import re
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


def load_skips():
    """skipped.txt: "NAME skipped (REASON)" / "NAME stopped (REASON)"; NAME is a
    run, or a peer ("redis", "nats") standing for all of its runs."""
    skips = []
    for line in read_text("skipped.txt").splitlines():
        m = re.match(r"^(\S+) (skipped|stopped) \((.*)\)$", line.strip())
        if m:
            skips.append(m.groups())
    return skips


SKIPS = load_skips()


def skip_of(name):
    """'skipped (time budget)' etc. if NAME was skipped or stopped, else None."""
    for key, verb, reason in SKIPS:
        if name == key or name.startswith(key + "-"):
            return "%s (%s)" % (verb, reason)
    return None


def status(doc):
    if doc is None:
        return "not run"
    if not doc.get("ok"):
        err = doc.get("first_error") or "; ".join(
            c["name"] + ": " + c["detail"] for c in doc.get("checks", []) if c.get("ok") is False
        )
        return "FAILED (%s)" % (err or "see log")
    return ""


def missing(name):
    """Why run NAME has no JSON: skipped/stopped, failed, or not run."""
    sk = skip_of(name)
    if sk:
        return sk
    if os.path.exists(os.path.join(D, name + ".log")):
        return "FAILED (see Run status)"
    return "not run"


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
        name = "%s-%s" % (key, prefix_workload)
        doc = load(name)
        cells.append(fn(doc) if doc is not None or not skip_of(name) else skip_of(name))
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
w("machine's, and the ratios as the comparison. Records are 100-byte payloads (except the")
w("disk-bandwidth runs in the targets table); streams have 2 shards (Redis: 2 stream keys,")
w("NATS: 2 JetStream streams). %s s warm-up, then %s s measured. The embedded Felix broker" % (m.get("warmup", "?"), m.get("duration", "?")))
w("runs on one core (`--broker-cores 1`).")
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
w(row("queue poll + ack (2 consumers, 500 a poll), records/s", cell_rate, "queue"))
w(row("e2e offered rate (½ min(publish, queue) peak), records/s", lambda d: "–" if d is None else fmt_int(d.get("offered_rate") or 0), "e2e"))
w(row("e2e publish→delivery p50", lambda d: "–" if d is None else fmt_us(d["latency"]["p50_us"]), "e2e"))
w(row("e2e publish→delivery p99", lambda d: "–" if d is None else fmt_us(d["latency"]["p99_us"]), "e2e"))
w(row("e2e publish→delivery p99.9 / max", lambda d: "–" if d is None else "%s / %s" % (fmt_us(d["latency"]["p999_us"]), fmt_us(d["latency"]["max_us"])), "e2e"))
w("")
q = load("felix-queued-publish")
if q:
    w("Felix with queued acks (`--ack queued`, acknowledged before fdatasync): **%s records/s**, ack p99 %s." % (cell_rate(q), fmt_us(q["latency"]["p99_us"])))
    w("")
elif missing("felix-queued-publish") != "not run":
    w("Felix with queued acks (`--ack queued`): %s." % missing("felix-queued-publish"))
    w("")
w("ᵈ the backlog ran out before the measurement time did (rate over the time it took). ⚠ the run reported errors or failed a check (see Run status).")
w("")

w("## Ratios (Felix ÷ peer, throughput)")
w("")
w("| workload | " + " | ".join(label for k, label in CONFIGS if k != "felix") + " |")
w("|---|" + "---:|" * (len(CONFIGS) - 1))
for wl, label in [("publish", "publish"), ("read", "read"), ("queue", "queue poll + ack")]:
    f = load("felix-" + wl)
    cells = []
    for k, _ in CONFIGS:
        if k == "felix":
            continue
        peer = "%s-%s" % (k, wl)
        why = skip_of(peer) or skip_of("felix-" + wl)
        cells.append(why if why and (f is None or load(peer) is None) else ratio(f, load(peer)))
    w("| %s | %s |" % (label, " | ".join(cells)))
w("")
w("Durable columns compare like with like (every acknowledged record is on disk: Felix")
w("acknowledges after fdatasync; Redis fsyncs the AOF before replying; NATS syncs every write).")
w("The default columns are the peers' out-of-the-box settings, which acknowledge before the")
w("data is on disk (Redis: no AOF / everysec; NATS: fsync every 2 minutes).")
w("")

# ---------------------------------------------------------------- targets
f1 = fio("fio-1m.json")
f1o = fio("fio-1m-overwrite.json")
f4 = fio("fio-4k.json")


def met(ok):
    return "met" if ok else "**not met**"


def target(label, names, measure, ok):
    """A targets-table row. NAMES are the runs it needs; MEASURE(docs) the
    measured cell; OK(docs) whether the target is met. A run that is missing
    makes the row "not measured" (and says why); a run that failed makes it
    "unverified" whatever its figure."""
    docs = [load(n) for n in names]
    for n, d in zip(names, docs):
        if d is None:
            why = missing(n)
            cell = why if len(names) == 1 else "`%s` %s" % (n, why)
            return "| %s | %s | not measured |" % (label, cell)
    verdict = met(ok(docs))
    if not all(d.get("ok") for d in docs):
        verdict = "**unverified** (a run failed; see Run status)"
    return "| %s | %s | %s |" % (label, measure(docs), verdict)


def rate_ratio(docs):
    return docs[0]["records_per_sec"] / docs[1]["records_per_sec"] if docs[1]["records_per_sec"] > 0 else 0.0


def ratio_cell(docs):
    return "%.2f× (%s ÷ %s records/s)" % (rate_ratio(docs), cell_rate(docs[0]), cell_rate(docs[1]))


def size(b):
    if b >= 1 << 20 and b % (1 << 20) == 0:
        return "%d MiB" % (b >> 20)
    if b >= 1 << 10 and b % (1 << 10) == 0:
        return "%d KiB" % (b >> 10)
    return "%d B" % b


def disk_row(name, default_shape):
    d = load(name)
    shape = default_shape
    if d:
        rs, batch = d["params"].get("record_size"), d["params"].get("batch")
        if rs and batch:
            shape = "%s batches (%s records × %d)" % (size(rs * batch), size(rs), batch)
    label = "durable publish ≥ 70 %% of the disk's fdatasync'd sequential bandwidth, %s" % shape
    if d is not None and f1 is None:
        why = skip_of("fio-1m") or ("fio not installed" if not m.get("fio") else "fio failed")
        return "| %s | %s MB/s; fio: %s | not measured |" % (label, fmt_int(d["mb_per_sec"]), why)

    def measure(docs):
        cell = "%s MB/s = %.0f %% of %s MB/s" % (fmt_int(docs[0]["mb_per_sec"]), 100 * docs[0]["mb_per_sec"] / f1["mbps"], fmt_int(f1["mbps"]))
        if f1o:
            cell += " (%.0f %% of the %s MB/s overwrite ceiling)" % (100 * docs[0]["mb_per_sec"] / f1o["mbps"], fmt_int(f1o["mbps"]))
        return cell
    return target(label, [name], measure, lambda docs: docs[0]["mb_per_sec"] >= 0.7 * f1["mbps"])


fe = load("felix-e2e")
w("## Felix against its targets")
w("")
w("| target | measured | |")
w("|---|---:|---|")
w(target("durable publish ≥ 1,000,000 records/s of 100 B", ["felix-publish"],
         lambda d: cell_rate(d[0]), lambda d: d[0]["records_per_sec"] >= 1e6))
w(target("durable publish ≥ 6× Redis (appendfsync always)", ["felix-publish", "redis-durable-publish"],
         ratio_cell, lambda d: rate_ratio(d) >= 6))
w(target("durable publish ≥ 4× NATS (defaults)", ["felix-publish", "nats-default-publish"],
         ratio_cell, lambda d: rate_ratio(d) >= 4))
w(disk_row("felix-disk-64k", "64 KiB batches"))
w(disk_row("felix-disk-1m", "1 MiB batches"))
for name, shape in [("felix-queue", "2 consumers, 500 a poll"),
                    ("felix-queue-16", "broker on 2 cores, 8 consumers, 16 a poll"),
                    ("felix-queue-256", "broker on 2 cores, 8 consumers, 256 a poll")]:
    w(target("queue poll + ack ≥ 500,000 records/s, %s" % shape, [name],
             lambda d: cell_rate(d[0]), lambda d: d[0]["records_per_sec"] >= 5e5))
for n in (16, 256):
    w(target("queue poll p99 < 2 ms at 50%% load, broker on 2 cores, 8 consumers, %d a poll" % n,
             ["felix-queue-%d-half" % n],
             lambda d: "%s at %s records/s (p50 %s)" % (fmt_us(d[0]["latency"]["p99_us"]), cell_rate(d[0]),
                                                     fmt_us(d[0]["latency"]["p50_us"])),
             lambda d: d[0]["latency"]["p99_us"] < 2000))
w(target("queue poll + ack ≥ 3× NATS (defaults), 2 consumers, 500 a poll", ["felix-queue", "nats-default-queue"],
         ratio_cell, lambda d: rate_ratio(d) >= 3))
w(target("e2e p99 ≤ 2 ms at 50%% of peak (%s records/s offered)" % (fmt_int(fe.get("offered_rate") or 0) if fe else "?"),
         ["felix-e2e"], lambda d: fmt_us(d[0]["latency"]["p99_us"]), lambda d: d[0]["latency"]["p99_us"] <= 2000))
w("")
w("Disk bandwidth: payload MB/s (10⁶ bytes, record framing not counted) of durably")
w("acknowledged publishes — 4 producers, 2 shards, each producer keeping 8 MiB of batches in")
w("flight (128 × 64 KiB or 8 × 1 MiB: enough to keep the disk busy) — against fio's")
w("1 MiB O_DIRECT sequential writes with an fdatasync after each, appending to a fresh file in")
w("the same directory, as a log does. fio run over a file it already wrote (what `--time_based`")
w("does once it wraps) only overwrites blocks already allocated and initialised, which syncs")
w("much faster; that figure is shown beside the target as the disk's raw ceiling.")
w("64 KiB is the smallest batch the issue's \"64 KiB+ batches\" covers; 1 MiB is fio's block.")
w("The queue rows at 16 and 256 a poll are the ends of the issue's range (broker on 2 cores,")
w("8 consumers, 2 shards, up to 16 acks in flight per consumer, each sent with the next poll);")
w("the 50 %-load rows pace the same consumers at half the rate each of those runs reached.")
w("Ratio targets compare the same workload on both brokers (Results above).")
w("")

# ---------------------------------------------------------------- run status
w("## Run status")
w("")
RUNS = ["%s-%s" % (k, wl) for k, _ in CONFIGS for wl in ["publish", "read", "queue", "e2e"]]
RUNS[4:4] = ["felix-disk-64k", "felix-disk-1m", "felix-queue-16", "felix-queue-256",
             "felix-queue-16-half", "felix-queue-256-half", "felix-queued-publish"]
any_bad = False
for name in RUNS:
    doc = load(name)
    if doc is None:
        if skip_of(name) or not os.path.exists(os.path.join(D, name + ".log")):
            continue  # listed with the skips below, or not run (--only)
        log = read_text(name + ".log").strip().splitlines()
        st = "FAILED: " + (log[-1] if log else "no output")
    else:
        st = status(doc)
    if st:
        any_bad = True
        w("- `%s`: %s" % (name, st))
budget_skips = [k for k, _, reason in SKIPS if reason == "time budget"]
shown = set()
for key, verb, reason in SKIPS:
    any_bad = True
    if key in shown:
        continue
    # A suite skipped whole (a peer mode the budget had no room for): one line.
    suite = key.rsplit("-", 1)[0]
    names = ["%s-%s" % (suite, wl) for wl in ["publish", "read", "queue", "e2e"]]
    if key in names and all((n, verb, reason) in SKIPS for n in names):
        shown.update(names)
        w("- `%s` (publish, read, queue, e2e): %s (%s)" % (suite, verb, reason))
    else:
        shown.add(key)
        w("- `%s`: %s (%s)" % (key, verb, reason))
if budget_skips:
    w("")
    w("%d run(s) did not fit the time budget (%s s, `COMPARE_BUDGET_SECS`; %s s used): skipped runs were" % (len(budget_skips), m.get("budget", "?"), m.get("elapsed", "?").rstrip("s")))
    w("not started, stopped runs were cut off when it ran out and count as not measured.")
if not any_bad:
    w("Every run completed and every count check passed (records stored = acknowledged,")
    w("records read = published, records left in the queue = backlog − acknowledged).")
w("")

w("## Machine and versions")
w("")
lo = iperf()
if m.get("elapsed") and m.get("budget"):
    m["elapsed"] = "%s s of a %s s budget (install/build included: %s s)" % (
        m["elapsed"].rstrip("s"), m["budget"], m.get("setup", "?").rstrip("s"))
w("| | |")
w("|---|---|")
for k, label in [("date", "date"), ("cpu_model", "CPU"), ("cpus", "CPUs"), ("memory", "memory"),
                 ("kernel", "kernel"), ("filesystem", "data filesystem"), ("rustc", "rustc"),
                 ("felix", "felix (git)"), ("redis", "redis-server"), ("nats", "nats-server"),
                 ("fio", "fio"), ("iperf3", "iperf3"), ("elapsed", "compare.sh run time")]:
    if m.get(k):
        w("| %s | %s |" % (label, m[k]))
if f1:
    w("| disk: 1 MiB O_DIRECT sequential appends to a fresh file, fdatasync each (fio) | %s MB/s |" % fmt_int(f1["mbps"]))
if f1o:
    w("| disk: the same over the written file (overwrites, fio) | %s MB/s |" % fmt_int(f1o["mbps"]))
elif skip_of("fio-1m"):
    w("| disk: 1 MiB O_DIRECT sequential writes, fdatasync each (fio) | %s |" % skip_of("fio-1m"))
if f4:
    extra = ""
    if f4.get("sync_p50_us") is not None:
        extra = ", fdatasync p50 %s / p99 %s" % (fmt_us(f4["sync_p50_us"]), fmt_us(f4["sync_p99_us"]))
    w("| disk: 4 KiB O_DIRECT writes, fdatasync each (fio) | %s writes/s%s |" % (fmt_int(f4["iops"]), extra))
elif skip_of("fio-4k"):
    w("| disk: 4 KiB O_DIRECT writes, fdatasync each (fio) | %s |" % skip_of("fio-4k"))
if lo:
    w("| loopback TCP (iperf3, 1 stream) | %.1f Gbit/s |" % lo)
elif skip_of("iperf3"):
    w("| loopback TCP (iperf3, 1 stream) | %s |" % skip_of("iperf3"))
w("")
if f1:
    w("The disk row is the ceiling for durable publishing: 100-byte records at the 1 MiB")
    w("fdatasync rate would be about %s records/s of payload." % fmt_int(f1["mbps"] * 1e6 / 100))
    w("")

w("## Commands")
w("")
w("```")
w(read_text("commands.txt").rstrip())
w("```")
w("")
w("NATS configuration files used are in `perf/results/latest/nats-*.conf`; Redis was started")
w("with `redis-server --appendonly yes --appendfsync always` (durable) or with no persistence options (defaults); both with")
w("`--port --bind 127.0.0.1 --dir --daemonize no --logfile` set for the run.")
print("\n".join(out))
