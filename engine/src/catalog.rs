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

/// The file in the data directory that a running broker holds locked.
pub const LOCK_FILE: &str = "felix.lock";

/// Exclusive use of a data directory for the life of a broker process.
///
/// Two brokers writing the same segments would corrupt each other's logs, so
/// the second one is refused. The lock is an `flock` on
/// `<data_dir>/felix.lock`: the kernel drops it when the holder exits, however
/// it exits (`kill -9` included), so a stale file never blocks a restart. The
/// holder's pid is written into the file for the error message.
#[derive(Debug)]
pub struct DirLock {
    _file: std::fs::File,
}

impl DirLock {
    /// Take the lock, or say who holds it.
    pub fn acquire(data_dir: &Path) -> Result<DirLock, String> {
        use std::io::{Read, Seek, Write};
        use std::os::fd::AsRawFd;
        let path = data_dir.join(LOCK_FILE);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        // SAFETY: flock on a descriptor this function owns.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                let who = if holder.is_empty() {
                    "another process".to_string()
                } else {
                    format!("another process (pid {holder})")
                };
                return Err(format!(
                    "data directory {} is in use by {who}; two brokers cannot share one \
                     (stop the other, or give this one its own --data-dir)",
                    data_dir.display()
                ));
            }
            return Err(format!("cannot lock {}: {err}", path.display()));
        }
        // The pid is advisory (for the message above); failing to write it
        // does not weaken the lock.
        let _ = file.set_len(0);
        let _ = file.seek(std::io::SeekFrom::Start(0));
        let _ = writeln!(file, "{}", std::process::id());
        Ok(DirLock { _file: file })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_data_directory_is_locked_by_one_holder_at_a_time() {
        let dir = std::env::temp_dir().join(format!("felix-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let first = DirLock::acquire(&dir).expect("first lock");
        let err = DirLock::acquire(&dir).expect_err("second lock refused");
        assert!(err.contains("in use by another process (pid"), "{err}");
        assert!(err.contains(&std::process::id().to_string()), "{err}");
        drop(first);
        let again = DirLock::acquire(&dir).expect("free once the holder let go");
        drop(again);
        // The lock file is not mistaken for a stream.
        assert!(load(&dir).unwrap().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

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
