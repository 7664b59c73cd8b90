//! An in-memory disk for tests that fails the way real disks fail.
//!
//! Every file keeps the bytes as of its last `sync` and the writes made since.
//! A simulated crash keeps the synced bytes and, per file, any prefix of the
//! unsynced writes — the last kept one possibly torn at any byte — or, with
//! [`CrashPlan::reorder`], any subset of them (the pages of a multi-page
//! O_DIRECT write, several in flight, reach the disk in no set order), and can
//! flip a bit in what survived of the unsynced data.
//!
//! Directory entries are crash-modelled too, when a plan asks
//! ([`CrashPlan::dir_entries`]): a file created since its directory was last
//! synced may vanish, and a file removed since then may come back (with what
//! it held as of its last sync). A removal by `remove_dir_all(d)` is durable
//! once `d`'s parent is synced. Directories themselves are not modelled.
//!
//! Writes, syncs and removals can be made to fail on the Nth call. All of it
//! is deterministic given a seed.
//!
//! Single-threaded by design (`Rc`), like everything on a Felix core.

use super::{PageBuf, Storage, StorageFile, ALIGN};
use bytes::Bytes;
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::rc::Rc;

#[derive(Clone, Default)]
struct SimFileState {
    /// Contents as of the last sync.
    synced: Vec<u8>,
    /// Contents now (what reads see).
    current: Vec<u8>,
    /// Writes and truncates since the last sync, in order.
    unsynced: Vec<Op>,
    /// The directory entry is durable (its parent was synced after creation).
    entry_durable: bool,
}

#[derive(Clone, Debug)]
enum Op {
    Write { pos: u64, data: Vec<u8> },
    Truncate { len: u64 },
}

fn apply(file: &mut Vec<u8>, op: &Op) {
    match op {
        Op::Write { pos, data } => {
            let end = *pos as usize + data.len();
            if file.len() < end {
                file.resize(end, 0);
            }
            file[*pos as usize..end].copy_from_slice(data);
        }
        Op::Truncate { len } => file.resize(*len as usize, 0),
    }
}

#[derive(Clone, Default)]
struct Disk {
    files: BTreeMap<PathBuf, SimFileState>,
    dirs: BTreeSet<PathBuf>,
    writes: u64,
    syncs: u64,
    fail_write_on: Option<u64>,
    fail_sync_on: Option<u64>,
    hang_sync_on: Option<u64>,
    /// While set, every fsync issued waits (in flight, counted) until
    /// [`SimStorage::release_syncs`]; the tasks it parked are kept here.
    syncs_held: bool,
    held_syncs: Vec<std::task::Waker>,
    /// Files removed since their directory was last synced: (path, state,
    /// the path whose parent directory's sync makes the removal durable).
    removed: Vec<(PathBuf, SimFileState, PathBuf)>,
    /// Calls of `remove_file` and `remove_dir_all` so far, and the one to fail.
    removes: u64,
    fail_remove_on: Option<u64>,
    /// Calls of `write_file_atomic` so far, and the one to fail.
    atomic_writes: u64,
    fail_atomic_write_on: Option<u64>,
    /// Calls of `sync_dir` so far, and the one to fail.
    dir_syncs: u64,
    fail_dir_sync_on: Option<u64>,
    /// Calls of `list_dir` so far, and the one to fail (out of open files).
    listings: u64,
    fail_listing_on: Option<u64>,
    /// Every write and sync yields to the executor once before it runs, so
    /// tests can interleave other work with an I/O in flight.
    yielding: bool,
    bytes_written: u64,
    /// What `space` answers (free, total); a roomy disk unless set.
    space: Option<(u64, u64)>,
}

impl Disk {
    /// Bring back files whose removal was not synced, where `back()` says
    /// so and nothing has taken the name since, with what they held as of
    /// their last sync.
    fn resurrect(&mut self, mut back: impl FnMut() -> bool) {
        for (path, mut f, _) in std::mem::take(&mut self.removed) {
            if back() && !self.files.contains_key(&path) {
                f.current = f.synced.clone();
                f.unsynced.clear();
                f.entry_durable = true;
                if let Some(dir) = path.parent() {
                    self.dirs.insert(dir.to_path_buf());
                }
                self.files.insert(path, f);
            }
        }
    }

    fn remove_failed(&mut self, path: &Path) -> Option<io::Error> {
        self.removes += 1;
        (self.fail_remove_on == Some(self.removes))
            .then(|| io::Error::other(format!("{}: simulated remove failure", path.display())))
    }
}

/// How a crash treats data that was not synced.
#[derive(Clone, Copy, Debug, Default)]
pub struct CrashPlan {
    /// Random source for choosing how many unsynced writes survive and where to tear.
    pub seed: u64,
    /// Allow the last surviving unsynced write to be torn at a random byte
    /// (with `reorder`: any write that does not survive whole may survive
    /// torn).
    pub tear: bool,
    /// Flip one bit somewhere in the surviving unsynced region of one file.
    pub flip_bit: bool,
    /// Each unsynced write survives or not on its own, not only a prefix of
    /// them in order. (Truncates and size changes still apply in order.)
    pub reorder: bool,
    /// Directory entries not yet synced may be lost: a file created since
    /// its directory's last sync may vanish, one removed since may come
    /// back. Without it, creations and removals are durable at once.
    pub dir_entries: bool,
}

/// A crash chosen exactly, for tests that enumerate crash points rather
/// than sample them.
#[derive(Clone, Debug, Default)]
pub struct ExactCrash {
    /// The file whose unsynced writes partly survive. Every other file keeps
    /// only what was synced.
    pub file: PathBuf,
    /// How many of its unsynced writes and truncates survive, in order.
    pub keep: usize,
    /// Of those, the ones that do not (indices into the unsynced writes
    /// and truncates): the pages of one flush land in no set order.
    pub lost: Vec<usize>,
    /// Bytes of the next unsynced write that survive (a torn write).
    pub tear: Option<usize>,
    /// A bit flipped afterwards: (byte, bit).
    pub flip: Option<(u64, u8)>,
    /// Every directory entry not yet synced is lost: files created since
    /// their directory's last sync vanish, files removed since come back.
    pub lose_dir_entries: bool,
}

/// A handle to the simulated disk; clones share it.
#[derive(Clone, Default)]
pub struct SimStorage {
    disk: Rc<RefCell<Disk>>,
}

/// A small deterministic generator so the simulator needs no dependency.
struct SplitMix(u64);
impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

impl SimStorage {
    pub fn new() -> Self {
        Self::default()
    }

    /// Make `space` answer `free` bytes free of `total`.
    pub fn set_space(&self, free: u64, total: u64) {
        self.disk.borrow_mut().space = Some((free, total));
    }

    /// The `n`th write from now (1 = the next one) fails with an I/O error.
    pub fn fail_write_after(&self, n: u64) {
        let mut d = self.disk.borrow_mut();
        d.fail_write_on = Some(d.writes + n);
    }

    /// The `n`th fsync from now (1 = the next one) fails with an I/O error.
    pub fn fail_sync_after(&self, n: u64) {
        let mut d = self.disk.borrow_mut();
        d.fail_sync_on = Some(d.syncs + n);
    }

    /// The `n`th `remove_file` or `remove_dir_all` from now (1 = the next
    /// one) fails with an I/O error and removes nothing.
    pub fn fail_remove_after(&self, n: u64) {
        let mut d = self.disk.borrow_mut();
        d.fail_remove_on = Some(d.removes + n);
    }

    /// The `n`th `write_file_atomic` from now (1 = the next one) fails
    /// with an I/O error and changes nothing.
    pub fn fail_atomic_write_after(&self, n: u64) {
        let mut d = self.disk.borrow_mut();
        d.fail_atomic_write_on = Some(d.atomic_writes + n);
    }

    /// The `n`th `sync_dir` from now (1 = the next one) fails with an I/O
    /// error and makes nothing durable.
    pub fn fail_dir_sync_after(&self, n: u64) {
        let mut d = self.disk.borrow_mut();
        d.fail_dir_sync_on = Some(d.dir_syncs + n);
    }

    /// The `n`th `list_dir` from now (1 = the next one) fails as a process
    /// out of open files does (EMFILE).
    pub fn fail_list_dir_after(&self, n: u64) {
        let mut d = self.disk.borrow_mut();
        d.fail_listing_on = Some(d.listings + n);
    }

    /// The `n`th fsync from now never completes: the power goes out while it
    /// is in flight. Drop the future, then [`SimStorage::crash`].
    pub fn hang_sync_after(&self, n: u64) {
        let mut d = self.disk.borrow_mut();
        d.hang_sync_on = Some(d.syncs + n);
    }

    /// Hold every fsync from now on in flight: it is issued (and counted)
    /// but does not complete until [`SimStorage::release_syncs`]. For tests
    /// of what happens between a write and the sync that makes it durable.
    pub fn hold_syncs(&self) {
        self.disk.borrow_mut().syncs_held = true;
    }

    /// Let the fsyncs held by [`SimStorage::hold_syncs`] complete, and stop
    /// holding new ones.
    pub fn release_syncs(&self) {
        let waiters = {
            let mut d = self.disk.borrow_mut();
            d.syncs_held = false;
            std::mem::take(&mut d.held_syncs)
        };
        for w in waiters {
            w.wake();
        }
    }

    /// Make every write, sync, directory sync and removal yield once before
    /// running (see `yielding`).
    pub fn set_yielding(&self, on: bool) {
        self.disk.borrow_mut().yielding = on;
    }

    /// Counts of write and sync calls so far.
    pub fn counts(&self) -> (u64, u64) {
        let d = self.disk.borrow();
        (d.writes, d.syncs)
    }

    /// Bytes handed to `write_at` so far (for write amplification).
    pub fn bytes_written(&self) -> u64 {
        self.disk.borrow().bytes_written
    }

    /// An independent copy of the disk as it stands (unsynced writes
    /// included), to crash in different ways from one state.
    pub fn fork(&self) -> SimStorage {
        SimStorage {
            disk: Rc::new(RefCell::new(self.disk.borrow().clone())),
        }
    }

    /// Position and length of each write made to `path` since its last sync.
    pub fn unsynced_writes(&self, path: &Path) -> Vec<(u64, usize)> {
        let d = self.disk.borrow();
        let Some(f) = d.files.get(path) else {
            return Vec::new();
        };
        f.unsynced
            .iter()
            .filter_map(|op| match op {
                Op::Write { pos, data } => Some((*pos, data.len())),
                Op::Truncate { .. } => None,
            })
            .collect()
    }

    /// Length of a file as of its last sync.
    pub fn synced_len(&self, path: &Path) -> Option<u64> {
        self.disk
            .borrow()
            .files
            .get(path)
            .map(|f| f.synced.len() as u64)
    }

    /// A power cut chosen exactly (see [`ExactCrash`]). Files created since
    /// their directory was synced survive it.
    pub fn crash_exact(&self, plan: &ExactCrash) {
        let mut d = self.disk.borrow_mut();
        if plan.lose_dir_entries {
            d.files.retain(|_, f| f.entry_durable);
            d.resurrect(|| true);
        }
        d.removed.clear();
        for (path, f) in d.files.iter_mut() {
            let mut img = f.synced.clone();
            if *path == plan.file {
                for (i, op) in f.unsynced.iter().enumerate() {
                    if i < plan.keep {
                        if !plan.lost.contains(&i) {
                            apply(&mut img, op);
                        }
                        continue;
                    }
                    if let (Some(cut), Op::Write { pos, data }) = (plan.tear, op) {
                        let cut = cut.min(data.len());
                        apply(
                            &mut img,
                            &Op::Write {
                                pos: *pos,
                                data: data[..cut].to_vec(),
                            },
                        );
                    }
                    break;
                }
                if let Some((byte, bit)) = plan.flip {
                    if let Some(b) = img.get_mut(byte as usize) {
                        *b ^= 1 << bit;
                    }
                }
            }
            f.synced = img.clone();
            f.current = img;
            f.unsynced.clear();
        }
        d.fail_sync_on = None;
        d.fail_write_on = None;
        d.hang_sync_on = None;
        d.fail_dir_sync_on = None;
        d.fail_remove_on = None;
        d.fail_atomic_write_on = None;
    }

    async fn maybe_yield(&self) {
        let yielding = self.disk.borrow().yielding;
        if yielding {
            futures_lite::future::yield_now().await;
        }
    }

    /// Lose everything that was not synced: the strictest power cut.
    pub fn crash_lose_unsynced(&self) {
        let mut d = self.disk.borrow_mut();
        d.files.retain(|_, f| f.entry_durable);
        d.resurrect(|| true);
        for f in d.files.values_mut() {
            f.current = f.synced.clone();
            f.unsynced.clear();
        }
        d.fail_sync_on = None;
        d.fail_write_on = None;
        d.hang_sync_on = None;
        d.fail_dir_sync_on = None;
        d.fail_remove_on = None;
        d.fail_atomic_write_on = None;
    }

    /// A power cut that keeps a random prefix (or, with `reorder`, subset)
    /// of each file's unsynced writes, possibly tearing one and flipping a
    /// bit in what survived, and (with `dir_entries`) loses random directory
    /// entries that were not synced.
    pub fn crash(&self, plan: CrashPlan) {
        let mut rng = SplitMix(plan.seed);
        let mut d = self.disk.borrow_mut();
        let mut vanished = Vec::new();
        let mut flip_done = !plan.flip_bit;
        for (path, f) in d.files.iter_mut() {
            if plan.dir_entries && !f.entry_durable && rng.below(2) == 0 {
                vanished.push(path.clone());
                continue;
            }
            let mut img = f.synced.clone();
            // Bytes that were already durable may be rewritten (the log
            // rewrites its partial tail page) but with the same contents; the
            // model is that such a rewrite cannot damage them, so flips land
            // only in data that was never synced.
            let synced_len = f.synced.len() as u64;
            let keep = rng.below(f.unsynced.len() as u64 + 1) as usize;
            let mut touched: Vec<(u64, u64)> = Vec::new();
            for (i, op) in f.unsynced.iter().enumerate() {
                let Op::Write { pos, data } = op else {
                    if plan.reorder || i < keep {
                        apply(&mut img, op);
                        continue;
                    }
                    break;
                };
                let cut = if plan.reorder {
                    match rng.below(if plan.tear { 3 } else { 2 }) {
                        0 => 0,
                        1 => data.len(),
                        _ => rng.below(data.len() as u64 + 1) as usize,
                    }
                } else if i < keep {
                    data.len()
                } else if i == keep && plan.tear {
                    rng.below(data.len() as u64 + 1) as usize
                } else {
                    break;
                };
                if cut > 0 {
                    apply(
                        &mut img,
                        &Op::Write {
                            pos: *pos,
                            data: data[..cut].to_vec(),
                        },
                    );
                    touched.push((*pos, *pos + cut as u64));
                }
                if !plan.reorder && i >= keep {
                    break;
                }
            }
            if !flip_done && !touched.is_empty() {
                // In the last write that survived (any, when reordered).
                let k = if plan.reorder {
                    rng.below(touched.len() as u64) as usize
                } else {
                    touched.len() - 1
                };
                let (a, b) = touched[k];
                let a = a.max(synced_len);
                if b > a && (b as usize) <= img.len() {
                    let at = a + rng.below(b - a);
                    img[at as usize] ^= 1 << rng.below(8);
                    flip_done = true;
                }
            }
            f.synced = img.clone();
            f.current = img;
            f.unsynced.clear();
        }
        for p in vanished {
            d.files.remove(&p);
        }
        if plan.dir_entries {
            d.resurrect(|| rng.below(2) == 0);
        }
        d.removed.clear();
        d.fail_sync_on = None;
        d.fail_write_on = None;
        d.hang_sync_on = None;
        d.fail_dir_sync_on = None;
        d.fail_remove_on = None;
        d.fail_atomic_write_on = None;
    }

    /// Flip one bit of a file as it stands, durably (media corruption).
    pub fn corrupt(&self, path: &Path, byte: u64, bit: u8) {
        let mut d = self.disk.borrow_mut();
        let f = d.files.get_mut(path).expect("corrupt: no such file");
        f.current[byte as usize] ^= 1 << bit;
        f.synced[byte as usize] ^= 1 << bit;
    }

    /// Overwrite bytes of a file, durably (a lost or misdirected write, or
    /// media damage). The file grows if needed.
    pub fn overwrite(&self, path: &Path, pos: u64, data: &[u8]) {
        let mut d = self.disk.borrow_mut();
        let f = d.files.get_mut(path).expect("overwrite: no such file");
        let op = Op::Write {
            pos,
            data: data.to_vec(),
        };
        apply(&mut f.current, &op);
        apply(&mut f.synced, &op);
    }

    /// Cut a file, durably (a hand-truncated file).
    pub fn cut(&self, path: &Path, len: u64) {
        let mut d = self.disk.borrow_mut();
        let f = d.files.get_mut(path).expect("cut: no such file");
        f.current.truncate(len as usize);
        f.synced.truncate(len as usize);
    }

    /// Paths of all files, for tests.
    pub fn files(&self) -> Vec<PathBuf> {
        self.disk.borrow().files.keys().cloned().collect()
    }

    /// Current length of a file.
    pub fn file_len(&self, path: &Path) -> Option<u64> {
        self.disk
            .borrow()
            .files
            .get(path)
            .map(|f| f.current.len() as u64)
    }
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("{}: no such file", path.display()),
    )
}

impl Storage for SimStorage {
    type File = SimFile;

    async fn open(&self, path: &Path, create: bool) -> io::Result<SimFile> {
        let mut d = self.disk.borrow_mut();
        if !d.files.contains_key(path) {
            if !create {
                return Err(not_found(path));
            }
            d.files.insert(path.to_path_buf(), SimFileState::default());
        }
        Ok(SimFile {
            disk: self.disk.clone(),
            path: path.to_path_buf(),
        })
    }

    async fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        self.disk.borrow_mut().dirs.insert(path.to_path_buf());
        Ok(())
    }

    async fn sync_dir(&self, path: &Path) -> io::Result<()> {
        self.maybe_yield().await;
        let mut d = self.disk.borrow_mut();
        d.dir_syncs += 1;
        if d.fail_dir_sync_on == Some(d.dir_syncs) {
            return Err(io::Error::other(format!(
                "{}: simulated directory sync failure",
                path.display()
            )));
        }
        for (p, f) in d.files.iter_mut() {
            if p.parent() == Some(path) {
                f.entry_durable = true;
            }
        }
        d.removed.retain(|(_, _, via)| via.parent() != Some(path));
        Ok(())
    }

    async fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        let mut d = self.disk.borrow_mut();
        d.listings += 1;
        if d.fail_listing_on == Some(d.listings) {
            return Err(io::Error::from_raw_os_error(libc::EMFILE));
        }
        let mut out = BTreeSet::new();
        for p in d.files.keys().chain(d.dirs.iter()) {
            if let Ok(rest) = p.strip_prefix(path) {
                if let Some(first) = rest.components().next() {
                    out.insert(first.as_os_str().to_string_lossy().into_owned());
                }
            }
        }
        Ok(out.into_iter().collect())
    }

    async fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.maybe_yield().await;
        let mut d = self.disk.borrow_mut();
        if let Some(e) = d.remove_failed(path) {
            return Err(e);
        }
        match d.files.remove(path) {
            Some(f) => {
                if f.entry_durable {
                    d.removed.push((path.to_path_buf(), f, path.to_path_buf()));
                }
                Ok(())
            }
            None => Err(not_found(path)),
        }
    }

    async fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        self.maybe_yield().await;
        let mut d = self.disk.borrow_mut();
        if let Some(e) = d.remove_failed(path) {
            return Err(e);
        }
        let gone: Vec<PathBuf> = d
            .files
            .keys()
            .filter(|p| p.starts_with(path))
            .cloned()
            .collect();
        for p in gone {
            let f = d.files.remove(&p).unwrap();
            if f.entry_durable {
                d.removed.push((p, f, path.to_path_buf()));
            }
        }
        // Removals made earlier under it now last as long as it does.
        for (p, _, via) in d.removed.iter_mut() {
            if p.starts_with(path) {
                *via = path.to_path_buf();
            }
        }
        d.dirs.retain(|p| !p.starts_with(path));
        Ok(())
    }

    async fn write_file_atomic(&self, path: &Path, data: &[u8]) -> io::Result<()> {
        let mut d = self.disk.borrow_mut();
        d.atomic_writes += 1;
        if d.fail_atomic_write_on == Some(d.atomic_writes) {
            return Err(io::Error::other(format!(
                "{}: simulated write failure",
                path.display()
            )));
        }
        // Renamed over the name and the directory synced: whatever was
        // removed under that name stays removed.
        d.removed.retain(|(p, _, _)| p != path);
        d.files.insert(
            path.to_path_buf(),
            SimFileState {
                synced: data.to_vec(),
                current: data.to_vec(),
                unsynced: Vec::new(),
                entry_durable: true,
            },
        );
        Ok(())
    }

    fn space(&self, _path: &Path) -> io::Result<(u64, u64)> {
        Ok(self.disk.borrow().space.unwrap_or((1 << 50, 1 << 50)))
    }

    async fn read_file(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        Ok(self
            .disk
            .borrow()
            .files
            .get(path)
            .map(|f| f.current.clone()))
    }
}

/// A file on the simulated disk.
pub struct SimFile {
    disk: Rc<RefCell<Disk>>,
    path: PathBuf,
}

impl SimFile {
    fn with<R>(&self, f: impl FnOnce(&mut SimFileState) -> R) -> io::Result<R> {
        let mut d = self.disk.borrow_mut();
        match d.files.get_mut(&self.path) {
            Some(state) => Ok(f(state)),
            None => Err(not_found(&self.path)),
        }
    }
}

impl StorageFile for SimFile {
    async fn write_at(&self, buf: PageBuf, len: usize, pos: u64) -> io::Result<PageBuf> {
        if self.disk.borrow().yielding {
            futures_lite::future::yield_now().await;
        }
        assert_eq!(pos % ALIGN as u64, 0, "unaligned write position {pos}");
        assert_eq!(len % ALIGN, 0, "unaligned write length");
        assert!(
            len <= buf.writable(),
            "write of {len} bytes from a buffer holding {} ({} writable)",
            buf.len(),
            buf.writable()
        );
        {
            let mut d = self.disk.borrow_mut();
            d.writes += 1;
            if d.fail_write_on == Some(d.writes) {
                return Err(io::Error::other("simulated write failure"));
            }
            d.bytes_written += len as u64;
        }
        let data = buf.filled()[..len].to_vec();
        self.with(|f| {
            let op = Op::Write { pos, data };
            apply(&mut f.current, &op);
            f.unsynced.push(op);
        })?;
        Ok(buf.written(len))
    }

    async fn read_at(&self, pos: u64, len: usize) -> io::Result<Bytes> {
        if self.disk.borrow().yielding {
            futures_lite::future::yield_now().await;
        }
        self.with(|f| {
            let start = (pos as usize).min(f.current.len());
            let end = (start + len).min(f.current.len());
            Bytes::copy_from_slice(&f.current[start..end])
        })
    }

    async fn sync(&self) -> io::Result<()> {
        // An fdatasync covers the writes completed before it was issued,
        // not those that land while it runs (as a real disk: a flusher that
        // wrote the next round during a sync must not count it as synced).
        let covered = self.with(|f| f.unsynced.len())?;
        if self.disk.borrow().yielding {
            futures_lite::future::yield_now().await;
        }
        let (hang, fail) = {
            let mut d = self.disk.borrow_mut();
            d.syncs += 1;
            (
                d.hang_sync_on == Some(d.syncs),
                d.fail_sync_on == Some(d.syncs),
            )
        };
        if hang {
            return std::future::pending::<io::Result<()>>().await;
        }
        std::future::poll_fn(|cx| {
            let mut d = self.disk.borrow_mut();
            if d.syncs_held {
                d.held_syncs.push(cx.waker().clone());
                std::task::Poll::Pending
            } else {
                std::task::Poll::Ready(())
            }
        })
        .await;
        if fail {
            // Like Linux after a failed fsync: the dirty data may be gone
            // and the error is not reported again. Drop it.
            return self
                .with(|f| {
                    f.current = f.synced.clone();
                    f.unsynced.clear();
                })
                .and(Err(io::Error::other("simulated fsync failure")));
        }
        self.with(|f| {
            // Apply the deltas rather than copying the file: O(bytes since
            // the last sync), not O(file).
            let covered = covered.min(f.unsynced.len());
            let ops: Vec<Op> = f.unsynced.drain(..covered).collect();
            for op in &ops {
                apply(&mut f.synced, op);
            }
            debug_assert!(!f.unsynced.is_empty() || f.synced.len() == f.current.len());
        })
    }

    async fn size(&self) -> io::Result<u64> {
        self.with(|f| f.current.len() as u64)
    }

    async fn truncate(&self, len: u64) -> io::Result<()> {
        self.with(|f| {
            let op = Op::Truncate { len };
            apply(&mut f.current, &op);
            f.unsynced.push(op);
        })
    }

    async fn allocate(&self, len: u64) -> io::Result<()> {
        // Like fallocate without KEEP_SIZE: the file grows, reading as zeros.
        // Modelled as an ordinary (unsynced) size change.
        self.with(|f| {
            if (f.current.len() as u64) < len {
                let op = Op::Truncate { len };
                apply(&mut f.current, &op);
                f.unsynced.push(op);
            }
        })
    }

    async fn close(self) -> io::Result<()> {
        Ok(())
    }
}
