//! A replica's hard state on disk: its term, its vote in that term and the
//! commit index it knew, in one small file per shard replaced atomically
//! (temporary file, sync, rename, sync the directory) whenever raft-rs
//! reports a change — at elections, and as the commit index moves.
//!
//! Losing a vote would let a replica vote twice in one term, so a file that
//! is there but does not decode is an error, never a fresh start. Layout,
//! little-endian:
//!
//! ```text
//! magic "FXRS" | version u8 = 1 | term u64 | vote u64 | commit u64 | crc32c u32
//! ```
//! (the checksum covers everything before it).

use std::io;
use std::path::Path;

use felix_engine::storage::Storage;
use raft::eraftpb::HardState;

/// The file's name in the shard's directory.
pub const HARD_STATE_FILE: &str = "raft.state";
const MAGIC: &[u8; 4] = b"FXRS";
const VERSION: u8 = 1;
const LEN: usize = 4 + 1 + 8 * 3 + 4;

/// Why a hard state could not be read back.
#[derive(Debug, thiserror::Error)]
pub enum HardStateError {
    #[error("reading the hard state: {0}")]
    Io(#[from] io::Error),
    #[error("the hard state file is damaged ({0}); refusing to start without the vote it held")]
    Corrupt(String),
}

/// The file's bytes for `hs`.
pub fn encode(hs: &HardState) -> [u8; LEN] {
    let mut out = [0u8; LEN];
    out[..4].copy_from_slice(MAGIC);
    out[4] = VERSION;
    out[5..13].copy_from_slice(&hs.term.to_le_bytes());
    out[13..21].copy_from_slice(&hs.vote.to_le_bytes());
    out[21..29].copy_from_slice(&hs.commit.to_le_bytes());
    let crc = crc32c::crc32c(&out[..29]);
    out[29..].copy_from_slice(&crc.to_le_bytes());
    out
}

/// Decode the file's bytes. Never panics.
pub fn decode(bytes: &[u8]) -> Result<HardState, HardStateError> {
    let bad = |why: String| Err(HardStateError::Corrupt(why));
    if bytes.len() != LEN {
        return bad(format!("{} bytes, expected {LEN}", bytes.len()));
    }
    if &bytes[..4] != MAGIC {
        return bad("not a hard state file".into());
    }
    let stored = u32::from_le_bytes(bytes[29..].try_into().expect("four bytes"));
    let computed = crc32c::crc32c(&bytes[..29]);
    if stored != computed {
        return bad(format!(
            "checksum {stored:#010x}, computed {computed:#010x}"
        ));
    }
    if bytes[4] != VERSION {
        return bad(format!("version {} (this build reads {VERSION})", bytes[4]));
    }
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("eight bytes"));
    Ok(HardState {
        term: u64_at(5),
        vote: u64_at(13),
        commit: u64_at(21),
        ..HardState::default()
    })
}

/// Make `hs` the shard's hard state, durably.
pub async fn store<S: Storage>(storage: &S, shard_dir: &Path, hs: &HardState) -> io::Result<()> {
    storage
        .write_file_atomic(&shard_dir.join(HARD_STATE_FILE), &encode(hs))
        .await
}

/// The shard's hard state: the default (term 0, no vote) if none was ever
/// stored, an error if the file is there but damaged.
pub async fn load<S: Storage>(storage: &S, shard_dir: &Path) -> Result<HardState, HardStateError> {
    match storage.read_file(&shard_dir.join(HARD_STATE_FILE)).await? {
        None => Ok(HardState::default()),
        Some(bytes) => decode(&bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hs(term: u64, vote: u64, commit: u64) -> HardState {
        HardState {
            term,
            vote,
            commit,
            ..HardState::default()
        }
    }

    #[test]
    fn round_trips_and_refuses_every_damaged_byte() {
        for h in [
            hs(0, 0, 0),
            hs(7, 2, 1_000),
            hs(u64::MAX, u64::MAX, u64::MAX),
        ] {
            let bytes = encode(&h);
            assert_eq!(decode(&bytes).unwrap(), h);
            for i in 0..LEN {
                for bit in 0..8 {
                    let mut bad = bytes;
                    bad[i] ^= 1 << bit;
                    assert!(decode(&bad).is_err(), "byte {i} bit {bit}");
                }
            }
            for cut in 0..LEN {
                assert!(decode(&bytes[..cut]).is_err());
            }
        }
    }

    #[test]
    fn stored_on_a_real_disk_it_reads_back_and_a_damaged_file_stops_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .spawn(move || async move {
                let storage = felix_engine::storage::dma::DmaStorage::new();
                assert_eq!(load(&storage, &path).await.unwrap(), HardState::default());
                store(&storage, &path, &hs(3, 1, 10)).await.unwrap();
                store(&storage, &path, &hs(4, 2, 12)).await.unwrap();
                assert_eq!(load(&storage, &path).await.unwrap(), hs(4, 2, 12));
                std::fs::write(path.join(HARD_STATE_FILE), b"garbage").unwrap();
                assert!(matches!(
                    load(&storage, &path).await,
                    Err(HardStateError::Corrupt(_))
                ));
            })
            .unwrap()
            .join()
            .unwrap();
    }
}
