//! Stream metadata: which streams exist, their shard counts and retention.
//!
//! Stream metadata is persisted durably, one small file per stream at
//! `<data_dir>/<tenant>/<namespace>/<stream>/stream.meta`, written atomically
//! (temporary file, fsync, rename, fsync directory) and validated on start.
//! The catalog is shared by all cores but consulted only by admin requests and
//! when a core meets a stream it has not seen: never on the publish/poll/ack
//! path, which uses each core's own shard table.

use crate::storage::Storage;
use crate::types::StreamName;
use std::path::{Path, PathBuf};

pub const META_FILE: &str = "stream.meta";
const META_VERSION: u64 = 1;
/// The most shards a stream can have (`limits.max_shards` is at most
/// this): metadata naming more is damage, not a stream to open.
pub const MAX_SHARDS: u32 = 1 << 16;

/// What is persisted about a stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamMeta {
    pub name: StreamName,
    pub shards: u32,
    pub retention_bytes: Option<u64>,
    pub retention_ms: Option<u64>,
    pub created_ms: u64,
    /// In a cluster: the number every broker holds for this stream, telling
    /// its replicas from those of an earlier stream of the same name (0:
    /// none, a stream created outside a cluster or by a client that did not
    /// send one). At most `i64::MAX` (the file is TOML).
    pub incarnation: u64,
}

impl StreamMeta {
    pub fn dir(&self, data_dir: &Path) -> PathBuf {
        stream_dir(data_dir, &self.name)
    }

    pub fn encode(&self) -> String {
        let mut text = format!(
            "# Felix stream metadata. Do not edit while the broker runs.\nversion = {META_VERSION}\nshards = {}\nretention_bytes = {}\nretention_ms = {}\ncreated_ms = {}\n",
            self.shards,
            self.retention_bytes.unwrap_or(0),
            self.retention_ms.unwrap_or(0),
            self.created_ms
        );
        if self.incarnation != 0 {
            text.push_str(&format!("incarnation = {}\n", self.incarnation));
        }
        text
    }

    /// The metadata a deletion writes first: the stream is gone from then
    /// on, and its files may be removed (see [`Meta::Deleted`]).
    pub fn encode_deleted(&self) -> String {
        format!("{}deleted = true\n", self.encode())
    }

    /// Read a metadata file: a stream, or one being deleted.
    pub fn read(name: StreamName, text: &str) -> Result<Meta, String> {
        let t = parse(text)?;
        match t.get("deleted") {
            None | Some(toml::Value::Boolean(false)) => {
                Ok(Meta::Stream(Self::from_table(name, &t)?))
            }
            Some(toml::Value::Boolean(true)) => Ok(Meta::Deleted),
            Some(v) => Err(format!("`deleted` = {v} is not true or false")),
        }
    }

    pub fn decode(name: StreamName, text: &str) -> Result<StreamMeta, String> {
        Self::from_table(name, &parse(text)?)
    }

    fn from_table(name: StreamName, t: &toml::Table) -> Result<StreamMeta, String> {
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
        if shards == 0 || shards > u64::from(MAX_SHARDS) {
            return Err(format!(
                "bad shard count {shards} (a stream has 1 to {MAX_SHARDS})"
            ));
        }
        let opt = |v: u64| if v == 0 { None } else { Some(v) };
        Ok(StreamMeta {
            name,
            shards: shards as u32,
            retention_bytes: opt(int("retention_bytes")?),
            retention_ms: opt(int("retention_ms")?),
            created_ms: int("created_ms")?,
            incarnation: if t.contains_key("incarnation") {
                int("incarnation")?
            } else {
                0
            },
        })
    }
}

fn parse(text: &str) -> Result<toml::Table, String> {
    text.parse().map_err(|e| format!("not valid TOML: {e}"))
}

/// What a stream's metadata file says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Meta {
    Stream(StreamMeta),
    /// A deletion began (it writes this first, then removes the files, then
    /// the directory): not a stream, and its files may go.
    Deleted,
}

/// The streams found at start-up, and those whose metadata cannot be read:
/// they are not served, and their files are kept.
#[derive(Debug, Default)]
pub struct Loaded {
    pub streams: Vec<StreamMeta>,
    pub damaged: Vec<(StreamName, String)>,
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

/// Find and validate every stream under `data_dir` (at start-up), reading
/// through the storage seam like every other disk access.
///
/// A stream is a `<tenant>/<namespace>/<stream>` directory holding a
/// [`META_FILE`]. A directory without one (a creation that did not complete,
/// or files whose metadata was lost) or with one that says `deleted` (a
/// deletion cut short) is not a stream; files where directories would be
/// (the broker's lock file) are passed over. Metadata that does not read is
/// reported in [`Loaded::damaged`], so that the broker serves every other
/// stream while refusing that one (and never clears its files). Only an
/// error listing the directories fails the load.
pub async fn load<S: Storage>(storage: &S, data_dir: &Path) -> Result<Loaded, String> {
    let mut out = Loaded::default();
    for (t, tp) in subdirs(storage, data_dir).await? {
        for (n, np) in subdirs(storage, &tp).await? {
            for (s, sp) in subdirs(storage, &np).await? {
                let meta_path = sp.join(META_FILE);
                let bytes = match storage.read_file(&meta_path).await {
                    Ok(Some(b)) => Some(b),
                    Ok(None) => None,
                    Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => continue,
                    Err(e) => {
                        // Unreadable (permissions, an I/O error): kept, and
                        // refused, like damaged metadata.
                        match StreamName::new(&t, &n, &s) {
                            Ok(name) => out
                                .damaged
                                .push((name, format!("{}: {e}", meta_path.display()))),
                            Err(_) => tracing::warn!("{}: {e}", meta_path.display()),
                        }
                        continue;
                    }
                };
                let Ok(name) = StreamName::new(&t, &n, &s) else {
                    if bytes.is_some() {
                        tracing::warn!(
                            "{}: stream metadata under a directory whose name is not a stream \
                             name; passed over",
                            meta_path.display()
                        );
                    }
                    continue;
                };
                let read = bytes.map(|b| match String::from_utf8(b) {
                    Ok(text) => StreamMeta::read(name.clone(), &text),
                    Err(_) => Err("not UTF-8 text".to_string()),
                });
                match read {
                    Some(Ok(Meta::Stream(meta))) => {
                        warn_extra_shards(storage, &sp, &meta).await;
                        out.streams.push(meta);
                    }
                    Some(Err(e)) => out
                        .damaged
                        .push((name, format!("{}: {e}", meta_path.display()))),
                    Some(Ok(Meta::Deleted)) | None => {
                        // Not a stream, but its files take space: say so
                        // once per directory (never removed unasked).
                        let what = if read.is_some() {
                            "a deletion cut short"
                        } else {
                            "files of a stream without its metadata (a creation cut short, or \
                             the file was lost)"
                        };
                        if storage
                            .list_dir(&sp)
                            .await
                            .is_ok_and(|v| v.len() > usize::from(read.is_some()))
                        {
                            tracing::warn!(
                                "{}: {what}: not a stream; see docs/operations.md (Recovery) \
                                 before creating {t}/{n}/{s} again or removing the directory",
                                sp.display()
                            );
                        }
                    }
                }
            }
        }
    }
    out.streams.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Say so when a stream's directory holds shard directories past its shard
/// count (its metadata edited by hand?): their records are not served.
async fn warn_extra_shards<S: Storage>(storage: &S, dir: &Path, meta: &StreamMeta) {
    let Ok(names) = storage.list_dir(dir).await else {
        return;
    };
    let extra: Vec<u32> = names
        .iter()
        .filter_map(|n| n.parse::<u32>().ok())
        .filter(|s| *s >= meta.shards)
        .collect();
    if !extra.is_empty() {
        tracing::warn!(
            "{}: shard directories {extra:?} are past the stream's {} shards ({META_FILE}); \
             their records are not served",
            dir.display(),
            meta.shards
        );
    }
}

/// Whether a creation of `name` may clear what its directory `dir` holds:
/// a deletion cut short (its metadata says `deleted`), or no segment file
/// (a creation cut short). Records whose metadata is missing or does not
/// read may be all that is left of a stream, and are not cleared without a
/// word; nor is a stream whose metadata reads.
pub async fn leftovers_may_go<S: Storage>(
    storage: &S,
    dir: &Path,
    name: &StreamName,
) -> std::io::Result<bool> {
    let meta = storage.read_file(&dir.join(META_FILE)).await?;
    let read = meta.map(|b| {
        String::from_utf8(b)
            .ok()
            .and_then(|t| StreamMeta::read(name.clone(), &t).ok())
    });
    match read {
        Some(Some(meta)) => Ok(meta == Meta::Deleted),
        Some(None) | None => Ok(!holds_segments(storage, dir).await?),
    }
}

/// Whether a stream directory holds any segment file (`<shard>/*.log`).
async fn holds_segments<S: Storage>(storage: &S, dir: &Path) -> std::io::Result<bool> {
    let names = match storage.list_dir(dir).await {
        Ok(v) => v,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    for n in names {
        if n.parse::<u32>().is_err() {
            continue;
        }
        match storage.list_dir(&dir.join(&n)).await {
            Ok(files) if files.iter().any(|f| f.ends_with(".log")) => return Ok(true),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {}
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}

/// The entries of directory `p` with their paths; nothing if `p` is missing
/// or is not a directory.
async fn subdirs<S: Storage>(storage: &S, p: &Path) -> Result<Vec<(String, PathBuf)>, String> {
    match storage.list_dir(p).await {
        Ok(mut names) => {
            names.sort();
            Ok(names
                .into_iter()
                .map(|n| {
                    let q = p.join(&n);
                    (n, q)
                })
                .collect())
        }
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
            ) =>
        {
            Ok(Vec::new())
        }
        Err(e) => Err(format!("{}: {e}", p.display())),
    }
}

/// The file in the data directory that a running broker holds locked.
pub const LOCK_FILE: &str = "felix.lock";

/// `<data_dir>/felix.cluster`: in a cluster, the node whose state the
/// directory holds and every node of its cluster (the broker writes and
/// checks it).
pub const CLUSTER_FILE: &str = "felix.cluster";

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
        // The lock file is not mistaken for a stream, on the real disk.
        let d = dir.clone();
        let found = glommio::LocalExecutorBuilder::default()
            .spawn(move || async move { load(&crate::storage::dma::DmaStorage::new(), &d).await })
            .unwrap()
            .join()
            .unwrap();
        let found = found.unwrap();
        assert!(found.streams.is_empty() && found.damaged.is_empty());
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
            incarnation: 0,
        };
        assert_eq!(StreamMeta::decode(name.clone(), &m.encode()).unwrap(), m);
        assert!(!m.encode().contains("incarnation"), "{}", m.encode());
        let m = StreamMeta {
            incarnation: i64::MAX as u64,
            ..m
        };
        assert_eq!(StreamMeta::decode(name.clone(), &m.encode()).unwrap(), m);
        let text = m.encode().replace(&i64::MAX.to_string(), "-1");
        assert!(StreamMeta::decode(name.clone(), &text).is_err());
        assert!(StreamMeta::decode(name.clone(), "version = 1\nshards = 0\n").is_err());
        // A count no stream can have (damage, or a hand edit) is refused
        // here, before anything is sized by it.
        for shards in [u64::from(MAX_SHARDS) + 1, 4_000_000_000] {
            let text = m
                .encode()
                .replace("shards = 4", &format!("shards = {shards}"));
            let err = StreamMeta::decode(name.clone(), &text).unwrap_err();
            assert!(err.contains("bad shard count"), "{err}");
        }
        let most = m
            .encode()
            .replace("shards = 4", &format!("shards = {MAX_SHARDS}"));
        assert_eq!(
            StreamMeta::decode(name.clone(), &most).unwrap().shards,
            MAX_SHARDS
        );
        assert!(StreamMeta::decode(name.clone(), "garbage ===").is_err());
        assert!(StreamMeta::decode(name, "version = 9\nshards = 1\n").is_err());
    }

    /// Loading the catalog on the simulated disk: streams with metadata are
    /// found in order, half-made and half-deleted ones and stray files are
    /// passed over, and metadata that does not read is reported (naming the
    /// file) while every other stream loads.
    #[test]
    fn load_finds_streams_skips_half_made_ones_and_names_a_bad_file() {
        use crate::storage::sim::SimStorage;
        use futures_lite::future::block_on;
        let disk = SimStorage::new();
        let root = Path::new("/data");
        block_on(async {
            let meta = |s: &str, shards| StreamMeta {
                name: StreamName::parse(s).unwrap(),
                shards,
                retention_bytes: None,
                retention_ms: Some(60_000),
                created_ms: 1,
                incarnation: 0,
            };
            assert!(
                load(&disk, root).await.unwrap().streams.is_empty(),
                "no data dir yet"
            );
            for m in [meta("t/n/b", 2), meta("t/n/a", 1), meta("u/m/c", 3)] {
                let dir = m.dir(root);
                disk.create_dir_all(&dir).await.unwrap();
                disk.write_file_atomic(&dir.join(META_FILE), m.encode().as_bytes())
                    .await
                    .unwrap();
            }
            // A creation that never wrote its metadata, and a stray file.
            disk.create_dir_all(&root.join("t/n/half/0")).await.unwrap();
            disk.write_file_atomic(&root.join(LOCK_FILE), b"123\n")
                .await
                .unwrap();
            // A deletion cut short.
            let gone = meta("t/n/gone", 1);
            disk.create_dir_all(&gone.dir(root).join("0"))
                .await
                .unwrap();
            disk.write_file_atomic(
                &gone.dir(root).join(META_FILE),
                gone.encode_deleted().as_bytes(),
            )
            .await
            .unwrap();
            let got = load(&disk, root).await.unwrap();
            let names: Vec<String> = got.streams.iter().map(|m| m.name.to_string()).collect();
            assert_eq!(names, ["t/n/a", "t/n/b", "u/m/c"]);
            assert_eq!(got.streams[2], meta("u/m/c", 3));
            assert!(got.damaged.is_empty());

            // Metadata that does not read: that stream is reported, the
            // others still load.
            let bad = root.join("t/n/b").join(META_FILE);
            for (bytes, says) in [
                (&b"shards = many"[..], "not valid TOML"),
                (&[0xff, 0xfe][..], "not UTF-8"),
                (&b"version = 1\nshards = 2\ndeleted = 3\n"[..], "`deleted`"),
            ] {
                disk.write_file_atomic(&bad, bytes).await.unwrap();
                let got = load(&disk, root).await.unwrap();
                let names: Vec<String> = got.streams.iter().map(|m| m.name.to_string()).collect();
                assert_eq!(names, ["t/n/a", "u/m/c"]);
                assert_eq!(got.damaged.len(), 1);
                let (name, why) = &got.damaged[0];
                assert_eq!(name.to_string(), "t/n/b");
                assert!(why.contains(&bad.display().to_string()), "{why}");
                assert!(why.contains(says), "{why}");
            }
        });
    }
}
