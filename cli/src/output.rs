//! How records and descriptions are printed.

use std::io::Write;

use felix_client::{
    DeadLetterInfo, GroupInfo, GroupRecord, Record, ReplicaInfo, ShardInfo, StreamInfo,
};
use serde::Serialize;
use serde_json::json;

use crate::args::Format;

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding.
pub fn base64(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        out.push(B64[(n >> 18) as usize & 63] as char);
        out.push(B64[(n >> 12) as usize & 63] as char);
        out.push(if chunk.len() > 1 {
            B64[(n >> 6) as usize & 63] as char
        } else {
            '='
        });
        out.push(if chunk.len() > 2 {
            B64[n as usize & 63] as char
        } else {
            '='
        });
    }
    out
}

/// Bytes as a string and the encoding used: "utf8" or "base64".
fn encoded(data: &[u8]) -> (String, &'static str) {
    match std::str::from_utf8(data) {
        Ok(s) => (s.to_string(), "utf8"),
        Err(_) => (base64(data), "base64"),
    }
}

#[derive(Serialize)]
struct JsonHeader {
    name: String,
    value: String,
    encoding: &'static str,
}

/// One record as a JSON line, fields in this order.
#[derive(Serialize)]
struct JsonRecord {
    #[serde(skip_serializing_if = "Option::is_none")]
    shard: Option<u32>,
    offset: u64,
    timestamp: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    attempts: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    skipped_before: Option<u64>,
    key: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    key_encoding: Option<&'static str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    headers: Vec<JsonHeader>,
    payload: String,
    payload_encoding: &'static str,
}

impl JsonRecord {
    fn new(
        offset: u64,
        timestamp_ms: u64,
        key: Option<&[u8]>,
        headers: &felix_client::Headers,
        payload: &[u8],
    ) -> JsonRecord {
        let (key, key_encoding) = match key.map(encoded) {
            Some((k, enc)) => (Some(k), Some(enc)),
            None => (None, None),
        };
        let (payload, payload_encoding) = encoded(payload);
        JsonRecord {
            shard: None,
            offset,
            timestamp: timestamp_ms,
            attempts: None,
            skipped_before: None,
            key,
            key_encoding,
            headers: headers
                .iter()
                .map(|(name, value)| {
                    let (value, encoding) = encoded(value);
                    JsonHeader {
                        name: name.to_owned(),
                        value,
                        encoding,
                    }
                })
                .collect(),
            payload,
            payload_encoding,
        }
    }

    fn write(&self, out: &mut impl Write) -> std::io::Result<()> {
        serde_json::to_writer(&mut *out, self)?;
        out.write_all(b"\n")
    }
}

fn write_payload_line(out: &mut impl Write, payload: &[u8]) -> std::io::Result<()> {
    out.write_all(String::from_utf8_lossy(payload).as_bytes())?;
    out.write_all(b"\n")
}

pub fn write_record(out: &mut impl Write, format: Format, r: &Record) -> std::io::Result<()> {
    match format {
        Format::Text => write_payload_line(out, &r.payload),
        Format::Json => JsonRecord::new(
            r.offset,
            r.timestamp_ms,
            r.key.as_deref(),
            &r.headers,
            &r.payload,
        )
        .write(out),
    }
}

/// One delivered record: in json with its attempts, and its shard when
/// `shard` names one (a consumer of every shard).
pub fn write_group_record(
    out: &mut impl Write,
    format: Format,
    shard: Option<u32>,
    r: &GroupRecord,
) -> std::io::Result<()> {
    match format {
        Format::Text => write_payload_line(out, &r.payload),
        Format::Json => {
            let mut j = JsonRecord::new(
                r.offset,
                r.timestamp_ms,
                r.key.as_deref(),
                &r.headers,
                &r.payload,
            );
            j.shard = shard;
            j.attempts = Some(r.attempts);
            // Only worth a field when something was actually skipped.
            j.skipped_before = r.skipped_before.filter(|n| *n > 0);
            j.write(out)
        }
    }
}

fn opt<T: std::fmt::Display>(v: Option<T>, none: &str) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| none.to_string())
}

/// Unix milliseconds as an RFC 3339 UTC time: `2026-12-02T05:32:04.693Z`.
pub fn utc(ms: u64) -> String {
    let secs = ms / 1000;
    let (year, month, day) = civil_from_days((secs / 86_400) as i64);
    let s = secs % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        s / 3600,
        s % 3600 / 60,
        s % 60,
        ms % 1000
    )
}

/// Days since 1970-01-01 as a (year, month, day) of the proleptic
/// Gregorian calendar, counting in 400-year eras of 146,097 days with years
/// starting on March 1st (so a leap day ends its year).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468; // days since 0000-03-01
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let march_month = (5 * day_of_year + 2) / 153; // 0 = March
    let day = (day_of_year - (153 * march_month + 2) / 5 + 1) as u32;
    let month = if march_month < 10 {
        march_month + 3
    } else {
        march_month - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// A past moment for people: its UTC time and how long ago it was.
fn when(ms: u64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let ago = match now.checked_sub(ms) {
        Some(d) if d < 1_000 => format!("{d} ms ago"),
        Some(d) => format!("{:.1} s ago", d as f64 / 1000.0),
        None => "ahead of this machine's clock".to_string(),
    };
    format!("{} ({ago})", utc(ms))
}

pub fn stream_line(s: &StreamInfo) -> String {
    format!(
        "{}\tshards={}\tretention_bytes={}\tretention_ms={}",
        s.stream,
        s.shards,
        opt(s.retention_bytes, "none"),
        opt(s.retention_ms, "none")
    )
}

pub fn stream_details(s: &StreamInfo) -> String {
    let placement: Vec<String> = s.placement.iter().map(|c| c.to_string()).collect();
    let mut text = format!(
        "stream           {}\nshards           {}\nretention_bytes  {}\nretention_ms     {}\nplacement        {}\n",
        s.stream,
        s.shards,
        opt(s.retention_bytes, "none"),
        opt(s.retention_ms, "none"),
        placement.join(" ")
    );
    // In a cluster: the same on every broker that holds this stream.
    if let Some(i) = s.incarnation {
        text.push_str(&format!("incarnation      {i:#018x}\n"));
    }
    text
}

/// Rows of cells, each column as wide as its widest cell, under a header.
fn aligned(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let cells: Vec<&str> = cells.collect();
        let mut l = String::new();
        for (i, (c, w)) in cells.iter().zip(&width).enumerate() {
            if i + 1 == cells.len() {
                l.push_str(c);
            } else {
                l.push_str(&format!("{c:<w$}  "));
            }
        }
        l.push('\n');
        l
    };
    let mut out = line(&mut header.iter().copied());
    for r in rows {
        out.push_str(&line(&mut r.iter().map(String::as_str)));
    }
    out
}

/// A shard's row in `stream describe`: described, or refused (a shard
/// that could not be opened is still shown, with the reason).
pub enum ShardRow {
    Described(ShardInfo),
    Refused {
        shard: u32,
        core: Option<u32>,
        why: String,
    },
}

/// One row per shard, aligned, under a header; on a cluster, with the
/// leader the broker asked knows of for each (`leaders`, by shard).
pub fn shard_table(shards: &[ShardRow], leaders: Option<&[String]>) -> String {
    let rows: Vec<Vec<String>> = shards
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut row = match s {
                ShardRow::Described(s) => vec![
                    s.shard.to_string(),
                    s.core.to_string(),
                    s.start_offset.to_string(),
                    s.end_offset.to_string(),
                    s.bytes.to_string(),
                    s.stopped.clone().unwrap_or_else(|| "no".into()),
                ],
                ShardRow::Refused { shard, core, why } => vec![
                    shard.to_string(),
                    core.map_or_else(|| "-".into(), |c| c.to_string()),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                    why.clone(),
                ],
            };
            if let Some(l) = leaders {
                row.push(l.get(i).cloned().unwrap_or_else(|| "-".into()));
            }
            row
        })
        .collect();
    let mut header = vec![
        "shard",
        "core",
        "start_offset",
        "end_offset",
        "bytes",
        "stopped",
    ];
    if leaders.is_some() {
        header.push("leader");
    }
    aligned(&header, &rows)
}

pub fn shard_details(s: &ShardInfo) -> String {
    format!(
        "stream        {}\nshard         {}\ncore          {}\nstart_offset  {}\nend_offset    {}\noffsets       {}\nbytes         {}\nsegments      {}\nstopped       {}\n",
        s.stream,
        s.shard,
        s.core,
        s.start_offset,
        s.end_offset,
        // Offsets held, not records: a new leader's start in a cluster
        // takes one too.
        s.end_offset.saturating_sub(s.start_offset),
        s.bytes,
        s.segments,
        s.stopped.as_deref().unwrap_or("no")
    )
}

/// A broker's replica of a shard, as it sees it: lines to follow
/// [`shard_details`].
pub fn replica_details(r: &ReplicaInfo) -> String {
    let mut out = format!(
        "replica       node {}, {} in term {}\nleader        {}\ncommit        {}\napplied       {}\nlast_index    {}\ncompacted     {}\n",
        r.node,
        r.role.name(),
        r.term,
        leader(r),
        r.commit,
        r.applied,
        r.last_index,
        r.compacted,
    );
    for p in &r.peers {
        out.push_str(&format!(
            "peer {:<8} holds up to {} ({} behind)\n",
            p.node,
            p.matched,
            r.last_index.saturating_sub(p.matched)
        ));
    }
    if let Some(why) = &r.stopped {
        out.push_str(&format!("stopped_why   {why}\n"));
    }
    out
}

/// Who leads, as a replica knows: `node 2 at 127.0.0.1:7410`, or `none
/// known`.
pub fn leader(r: &ReplicaInfo) -> String {
    match (r.leader, &r.leader_addr) {
        (Some(id), Some(addr)) => format!("node {id} at {addr}"),
        (Some(id), None) => format!("node {id}"),
        (None, _) => "none known".to_string(),
    }
}

/// One broker's answer for [`replica_table`]: its replica, or why not
/// (`unreachable` or `refused`, and the error).
pub type ReplicaAnswer = Result<ReplicaInfo, (&'static str, String)>;

/// Every broker's replica of a shard, one row each: a broker that did not
/// answer has `unreachable` or `refused` for its role (the error follows
/// the table) in place of the figures.
pub fn replica_table(answers: &[(String, ReplicaAnswer)]) -> String {
    let rows: Vec<Vec<String>> = answers
        .iter()
        .map(|(broker, r)| match r {
            Ok(r) => vec![
                broker.clone(),
                r.node.to_string(),
                r.role.name().to_string(),
                r.term.to_string(),
                r.leader.map_or_else(|| "-".to_string(), |l| l.to_string()),
                r.commit.to_string(),
                r.applied.to_string(),
                r.last_index.to_string(),
                r.compacted.to_string(),
            ],
            Err(e) => {
                let mut row = vec!["-".to_string(); 9];
                row[0] = broker.clone();
                row[2] = e.0.to_string();
                row
            }
        })
        .collect();
    let why: String = answers
        .iter()
        .filter_map(|(broker, r)| r.as_ref().err().map(|e| format!("{broker}: {}\n", e.1)))
        .collect();
    let table = aligned(
        &[
            "broker",
            "node",
            "role",
            "term",
            "leader",
            "commit",
            "applied",
            "last_index",
            "compacted",
        ],
        &rows,
    );
    format!("{table}{why}")
}

pub fn group_details(g: &GroupInfo) -> String {
    format!(
        "group                    {}\nposition                 {}\nstart_offset             {}\nend_offset               {}\nlag                      {}\nin_flight                {}\nowed                     {}\ndelayed                  {}\ndead_letters             {}\noldest_in_flight_age_ms  {}\noldest_owed_age_ms       {}\nlast_active              {}\n",
        g.group,
        g.position,
        g.start_offset,
        g.end_offset,
        g.lag(),
        g.in_flight,
        g.owed,
        g.delayed,
        g.dead_letters,
        opt(g.oldest_in_flight_age_ms, "-"),
        opt(g.oldest_owed_age_ms, "-"),
        g.last_active_ms.map_or_else(|| "-".to_string(), when),
    )
}

/// A group on one shard of a stream: as described, or not there yet (no
/// poll has reached that shard) with the shard it will start on.
pub enum ShardGroup {
    Polled(GroupInfo),
    NotYet(ShardInfo),
}

/// A group on every shard: one row per shard, then the totals. A shard
/// the group has not polled yet shows its end and, as lag, every record it
/// holds (the group's first poll there starts at its start), and `-` for
/// the rest.
pub fn group_shards_table(infos: &[ShardGroup]) -> String {
    let mut rows = Vec::with_capacity(infos.len() + 1);
    let mut total = [0u64; 5];
    for (shard, g) in infos.iter().enumerate() {
        let g = match g {
            ShardGroup::Polled(g) => g,
            ShardGroup::NotYet(held) => {
                // Its first poll starts it at the shard's start: everything
                // the shard holds is owed.
                let lag = held.end_offset.saturating_sub(held.start_offset);
                total[0] += lag;
                let mut row = vec![
                    shard.to_string(),
                    "-".to_string(),
                    held.end_offset.to_string(),
                    lag.to_string(),
                ];
                row.extend(std::iter::repeat_n("-".to_string(), 4));
                rows.push(row);
                continue;
            }
        };
        let counts = [
            g.lag(),
            u64::from(g.in_flight),
            u64::from(g.owed),
            u64::from(g.delayed),
            u64::from(g.dead_letters),
        ];
        for (t, v) in total.iter_mut().zip(counts) {
            *t += v;
        }
        let mut row = vec![
            shard.to_string(),
            g.position.to_string(),
            g.end_offset.to_string(),
        ];
        row.extend(counts.iter().map(u64::to_string));
        rows.push(row);
    }
    let mut row = vec!["all".to_string(), "-".into(), "-".into()];
    row.extend(total.iter().map(u64::to_string));
    rows.push(row);
    aligned(
        &[
            "shard",
            "position",
            "end_offset",
            "lag",
            "in_flight",
            "owed",
            "delayed",
            "dead_letters",
        ],
        &rows,
    )
}

pub fn dead_letter_line(d: &DeadLetterInfo, format: Format) -> String {
    let by = if d.by_consumer { "consumer" } else { "broker" };
    match format {
        Format::Text => format!(
            "{}\tattempts={}\tat={}\tby={}\treason={}",
            d.offset,
            d.attempts,
            utc(d.at_ms),
            by,
            d.reason.as_deref().unwrap_or("-")
        ),
        Format::Json => json!({
            "offset": d.offset,
            "attempts": d.attempts,
            "at_ms": d.at_ms,
            "by": by,
            "reason": d.reason,
        })
        .to_string(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn unix_milliseconds_print_as_utc_times() {
        use super::utc;
        assert_eq!(utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(utc(1_796_189_524_693), "2026-12-02T05:32:04.693Z");
        assert_eq!(utc(4_102_444_799_999), "2099-12-31T23:59:59.999Z");
        assert_eq!(utc(1_709_251_199_000), "2024-02-29T23:59:59.000Z");
        assert_eq!(utc(1_709_251_200_000), "2024-03-01T00:00:00.000Z");
    }

    use super::*;
    use bytes::Bytes;
    use serde_json::Value;

    #[test]
    fn base64_matches_the_rfc_vectors() {
        for (input, want) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(input.as_bytes()), want);
        }
        assert_eq!(base64(&[0xff, 0xfe, 0x00]), "//4A");
    }

    #[test]
    fn json_records_say_how_the_payload_is_encoded() {
        let r = Record {
            offset: 3,
            timestamp_ms: 9,
            key: Some(Bytes::from_static(b"k")),
            headers: Default::default(),
            payload: Bytes::from_static(b"hello"),
        };
        let mut out = Vec::new();
        write_record(&mut out, Format::Json, &r).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert!(std::str::from_utf8(&out)
            .unwrap()
            .starts_with("{\"offset\":3,"));
        assert_eq!(v["offset"], 3);
        assert_eq!(v["timestamp"], 9);
        assert_eq!(v["key"], "k");
        assert_eq!(v["payload"], "hello");
        assert_eq!(v["payload_encoding"], "utf8");

        let r = Record {
            payload: Bytes::from_static(&[0xff, 0x00]),
            key: None,
            ..r
        };
        let mut out = Vec::new();
        write_record(&mut out, Format::Json, &r).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["payload"], "/wA=");
        assert_eq!(v["payload_encoding"], "base64");
        assert_eq!(v["key"], Value::Null);

        let mut out = Vec::new();
        write_record(&mut out, Format::Text, &r).unwrap();
        assert_eq!(out, "\u{fffd}\u{0}\n".as_bytes());
    }
}
