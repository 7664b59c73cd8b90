//! Stream metadata: which streams exist, their shard counts and retention.
//!
//! Stream metadata is persisted durably, one small file per stream at
//! `<data_dir>/<tenant>/<namespace>/<stream>/stream.meta`, written atomically
//! (temporary file, fsync, rename, fsync directory) and validated on start.
//! The catalog is shared by all cores but consulted only by admin requests and
//! when a core meets a stream it has not seen: never on the publish/poll/ack
//! path, which uses each core's own shard table.

use crate::types::StreamName;
use std::path::{Path, PathBuf};

pub const META_FILE: &str = "stream.meta";
const META_VERSION: u64 = 1;

/// What is persisted about a stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamMeta {
    pub name: StreamName,
    pub shards: u32,
    pub retention_bytes: Option<u64>,
    pub retention_ms: Option<u64>,
    pub created_ms: u64,
}

impl StreamMeta {
    pub fn dir(&self, data_dir: &Path) -> PathBuf {
        stream_dir(data_dir, &self.name)
    }

    pub fn encode(&self) -> String {
        format!(
            "# Felix stream metadata. Do not edit while the broker runs.\nversion = {META_VERSION}\nshards = {}\nretention_bytes = {}\nretention_ms = {}\ncreated_ms = {}\n",
            self.shards,
            self.retention_bytes.unwrap_or(0),
            self.retention_ms.unwrap_or(0),
            self.created_ms
        )
    }

    pub fn decode(name: StreamName, text: &str) -> Result<StreamMeta, String> {
        let t: toml::Table = text.parse().map_err(|e| format!("not valid TOML: {e}"))?;
        let int = |k: &str| -> Result<u64, String> {
            match t.get(k) {
                Some(toml::Value::Integer(i)) if *i >= 0 => Ok(*i as u64),
                Some(v) => Err(format!("`{k}` = {v} is not a non-negative integer")),
                None => Err(format!("`{k}` is missing")),
            }
        };
        let version = int("version")?;
        if version != META_VERSION {
            return Err(format!("unknown metadata version {version}"));
        }
        let shards = int("shards")?;
        if shards == 0 || shards > u32::MAX as u64 {
            return Err(format!("bad shard count {shards}"));
        }
        let opt = |v: u64| if v == 0 { None } else { Some(v) };
        Ok(StreamMeta {
            name,
            shards: shards as u32,
            retention_bytes: opt(int("retention_bytes")?),
            retention_ms: opt(int("retention_ms")?),
            created_ms: int("created_ms")?,
        })
    }
}

pub fn stream_dir(data_dir: &Path, name: &StreamName) -> PathBuf {
    data_dir
        .join(name.tenant())
        .join(name.namespace())
        .join(name.stream())
}

pub fn shard_dir(data_dir: &Path, name: &StreamName, shard: u32) -> PathBuf {
    stream_dir(data_dir, name).join(shard.to_string())
}

/// Find and validate every stream under `data_dir` (blocking; at start-up).
pub fn load(data_dir: &Path) -> Result<Vec<StreamMeta>, String> {
    let mut out = Vec::new();
    if !data_dir.exists() {
        return Ok(out);
    }
    let dirs = |p: &Path| -> Result<Vec<(String, PathBuf)>, String> {
        let mut v = Vec::new();
        for e in std::fs::read_dir(p).map_err(|e| format!("{}: {e}", p.display()))? {
            let e = e.map_err(|e| format!("{}: {e}", p.display()))?;
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                v.push((e.file_name().to_string_lossy().into_owned(), e.path()));
            }
        }
        Ok(v)
    };
    for (t, tp) in dirs(data_dir)? {
        for (n, np) in dirs(&tp)? {
            for (s, sp) in dirs(&np)? {
                let meta_path = sp.join(META_FILE);
                let text = match std::fs::read_to_string(&meta_path) {
                    Ok(t) => t,
                    // A directory without metadata: a stream whose creation
                    // did not complete, or one being deleted. Not a stream.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(format!("{}: {e}", meta_path.display())),
                };
                let name =
                    StreamName::new(&t, &n, &s).map_err(|e| format!("{}: {e}", sp.display()))?;
                let meta = StreamMeta::decode(name, &text)
                    .map_err(|e| format!("{}: {e}", meta_path.display()))?;
                out.push(meta);
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips_and_is_validated() {
        let name = StreamName::parse("t/n/s").unwrap();
        let m = StreamMeta {
            name: name.clone(),
            shards: 4,
            retention_bytes: Some(10),
            retention_ms: None,
            created_ms: 5,
        };
        assert_eq!(StreamMeta::decode(name.clone(), &m.encode()).unwrap(), m);
        assert!(StreamMeta::decode(name.clone(), "version = 1\nshards = 0\n").is_err());
        assert!(StreamMeta::decode(name.clone(), "garbage ===").is_err());
        assert!(StreamMeta::decode(name, "version = 9\nshards = 1\n").is_err());
    }
}
