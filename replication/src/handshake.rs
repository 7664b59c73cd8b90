//! Who is on the other end of a replication connection.
//!
//! Replication connections run one way: a broker's core dials each peer's
//! listener and only writes frames. Before the first frame the two
//! exchange three fixed-size messages:
//!
//! ```text
//! challenge  (listener → dialer)  "FXRC" | version u8 | nonce [32]
//! proof      (dialer → listener)  "FXRP" | version u8 | from u64 | to u64 | mac [32]
//!            mac = HMAC-SHA256(key, "FXRP" | version | from | to | nonce)
//! accept     (listener → dialer)  "FXRA" | mac [32]
//!            mac = HMAC-SHA256(key, "FXRA" | version | from | to | nonce)
//! ```
//!
//! The listener makes a fresh random nonce for every connection; the
//! dialer proves it knows the cluster's key for that nonce, names itself
//! (`from`) and the node it meant to reach (`to`). The listener takes only
//! a proof for its own id from one of its peers, answers it with its own
//! proof (so the dialer knows it reached a broker of its cluster, and that
//! it was taken: a refusal is a closed connection), and from then on takes
//! only messages from that peer to itself. The key is derived from the
//! cluster's shared secret ([`PeerKey::from_secret`]); a cluster without
//! one uses the key of the empty secret, which authenticates nothing but
//! still catches a broker pointed at the wrong node or at another
//! cluster's port with a different secret, and a build of another version.
//!
//! Every broker holds the same key, so the handshake tells a broker of the
//! cluster from anything else, not one broker from another: a broker that
//! knows the secret could claim any id. It authenticates; it does not
//! encrypt. Frames after the handshake carry a CRC, not a MAC: an attacker
//! on the path between two brokers can still read and alter them, so
//! replication traffic belongs on a private network (or a tunnel such as
//! WireGuard).

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::wire::WIRE_VERSION;

/// Bytes of the listener's challenge.
pub const CHALLENGE_BYTES: usize = 4 + 1 + 32;
/// Bytes of the dialer's proof.
pub const PROOF_BYTES: usize = 4 + 1 + 8 + 8 + 32;
/// Bytes of the listener's acceptance.
pub const ACCEPT_BYTES: usize = 4 + 32;

const CHALLENGE_MAGIC: &[u8; 4] = b"FXRC";
const PROOF_MAGIC: &[u8; 4] = b"FXRP";
const ACCEPT_MAGIC: &[u8; 4] = b"FXRA";

type HmacSha256 = Hmac<Sha256>;

/// The key a cluster's brokers prove themselves with.
#[derive(Clone, PartialEq, Eq)]
pub struct PeerKey([u8; 32]);

impl std::fmt::Debug for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == PeerKey::open() {
            f.write_str("PeerKey(no secret)")
        } else {
            f.write_str("PeerKey(from a secret)")
        }
    }
}

impl Default for PeerKey {
    fn default() -> Self {
        PeerKey::open()
    }
}

impl PeerKey {
    /// The key of a cluster sharing `secret`.
    pub fn from_secret(secret: &[u8]) -> PeerKey {
        let mut h = Sha256::new();
        h.update(b"felix replication peer key\0");
        h.update(secret);
        PeerKey(h.finalize().into())
    }

    /// The key of a cluster without a secret (the empty one).
    pub fn open() -> PeerKey {
        PeerKey::from_secret(b"")
    }

    /// Whether this is the key of no secret.
    pub fn is_open(&self) -> bool {
        *self == PeerKey::open()
    }

    fn mac(&self) -> HmacSha256 {
        HmacSha256::new_from_slice(&self.0).expect("HMAC takes a key of any length")
    }
}

/// Why a handshake failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    #[error("the peer did not open with a Felix replication handshake (an older build, or not a Felix broker?)")]
    NotFelix,
    #[error("the peer speaks replication version {0}, this build {WIRE_VERSION}: upgrade every broker of a cluster together")]
    Version(u8),
    #[error("the peer meant node {to}, and this is node {me}: check cluster.nodes on both")]
    WrongNode { to: u64, me: u64 },
    #[error("node {0} is not one of this broker's peers")]
    UnknownPeer(u64),
    #[error("node {0} did not prove it knows the cluster's secret (is cluster.secret_file the same on both brokers?)")]
    BadProof(u64),
    #[error("node {0} answered without proving it knows the cluster's secret (is cluster.secret_file the same on both brokers, and is this its replication port?)")]
    BadAccept(u64),
}

/// A fresh random nonce for one connection.
pub fn nonce() -> [u8; 32] {
    rand::random()
}

/// The listener's challenge for `nonce`.
pub fn challenge(nonce: &[u8; 32]) -> [u8; CHALLENGE_BYTES] {
    let mut out = [0u8; CHALLENGE_BYTES];
    out[..4].copy_from_slice(CHALLENGE_MAGIC);
    out[4] = WIRE_VERSION;
    out[5..].copy_from_slice(nonce);
    out
}

/// The nonce of a challenge the dialer read.
pub fn read_challenge(bytes: &[u8; CHALLENGE_BYTES]) -> Result<[u8; 32], HandshakeError> {
    if &bytes[..4] != CHALLENGE_MAGIC {
        return Err(HandshakeError::NotFelix);
    }
    if bytes[4] != WIRE_VERSION {
        return Err(HandshakeError::Version(bytes[4]));
    }
    Ok(bytes[5..].try_into().expect("32 bytes"))
}

/// The listener's acceptance of `from`'s proof: its own proof, for the
/// same nonce, that it knows `key`.
pub fn accept(key: &PeerKey, nonce: &[u8; 32], from: u64, to: u64) -> [u8; ACCEPT_BYTES] {
    let mut out = [0u8; ACCEPT_BYTES];
    out[..4].copy_from_slice(ACCEPT_MAGIC);
    let tag = mac_of(key, &accept_head(from, to), nonce)
        .finalize()
        .into_bytes();
    out[4..].copy_from_slice(&tag);
    out
}

/// Check the listener's acceptance (the dialer, `from`, reached `to`).
pub fn check_accept(
    key: &PeerKey,
    nonce: &[u8; 32],
    from: u64,
    to: u64,
    bytes: &[u8; ACCEPT_BYTES],
) -> Result<(), HandshakeError> {
    if &bytes[..4] != ACCEPT_MAGIC {
        return Err(HandshakeError::BadAccept(to));
    }
    mac_of(key, &accept_head(from, to), nonce)
        .verify_slice(&bytes[4..])
        .map_err(|_| HandshakeError::BadAccept(to))
}

fn accept_head(from: u64, to: u64) -> [u8; 21] {
    let mut head = [0u8; 21];
    head[..4].copy_from_slice(ACCEPT_MAGIC);
    head[4] = WIRE_VERSION;
    head[5..13].copy_from_slice(&from.to_le_bytes());
    head[13..].copy_from_slice(&to.to_le_bytes());
    head
}

fn mac_of(key: &PeerKey, head: &[u8], nonce: &[u8; 32]) -> HmacSha256 {
    let mut m = key.mac();
    m.update(head);
    m.update(nonce);
    m
}

/// The dialer's proof: it is `from`, it meant to reach `to`, and it knows
/// `key`, for the listener's `nonce`.
pub fn prove(key: &PeerKey, nonce: &[u8; 32], from: u64, to: u64) -> [u8; PROOF_BYTES] {
    let mut out = [0u8; PROOF_BYTES];
    out[..4].copy_from_slice(PROOF_MAGIC);
    out[4] = WIRE_VERSION;
    out[5..13].copy_from_slice(&from.to_le_bytes());
    out[13..21].copy_from_slice(&to.to_le_bytes());
    let tag = mac_of(key, &out[..21], nonce).finalize().into_bytes();
    out[21..].copy_from_slice(&tag);
    out
}

/// Check a dialer's proof against the `nonce` this listener (node `me`)
/// sent: the peer it is, if the proof holds for `key` and `is_peer` knows
/// it. The MAC is compared in constant time.
pub fn check_proof(
    key: &PeerKey,
    nonce: &[u8; 32],
    me: u64,
    is_peer: impl Fn(u64) -> bool,
    bytes: &[u8; PROOF_BYTES],
) -> Result<u64, HandshakeError> {
    if &bytes[..4] != PROOF_MAGIC {
        return Err(HandshakeError::NotFelix);
    }
    if bytes[4] != WIRE_VERSION {
        return Err(HandshakeError::Version(bytes[4]));
    }
    let from = u64::from_le_bytes(bytes[5..13].try_into().expect("8 bytes"));
    let to = u64::from_le_bytes(bytes[13..21].try_into().expect("8 bytes"));
    if to != me {
        return Err(HandshakeError::WrongNode { to, me });
    }
    if from == me || !is_peer(from) {
        return Err(HandshakeError::UnknownPeer(from));
    }
    mac_of(key, &bytes[..21], nonce)
        .verify_slice(&bytes[21..])
        .map_err(|_| HandshakeError::BadProof(from))?;
    Ok(from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(id: u64) -> bool {
        (1..=3).contains(&id)
    }

    #[test]
    fn a_proof_for_the_nonce_is_accepted() {
        let key = PeerKey::from_secret(b"s3cret");
        let n = nonce();
        assert_eq!(read_challenge(&challenge(&n)), Ok(n));
        let p = prove(&key, &n, 2, 1);
        assert_eq!(check_proof(&key, &n, 1, peers, &p), Ok(2));
    }

    #[test]
    fn every_bad_proof_is_refused() {
        let key = PeerKey::from_secret(b"s3cret");
        let n = nonce();
        let other = PeerKey::from_secret(b"other");
        assert_eq!(
            check_proof(&key, &n, 1, peers, &prove(&other, &n, 2, 1)),
            Err(HandshakeError::BadProof(2)),
            "another secret"
        );
        assert_eq!(
            check_proof(&key, &n, 1, peers, &prove(&PeerKey::open(), &n, 2, 1)),
            Err(HandshakeError::BadProof(2)),
            "no secret"
        );
        assert_eq!(
            check_proof(&key, &nonce(), 1, peers, &prove(&key, &n, 2, 1)),
            Err(HandshakeError::BadProof(2)),
            "a proof replayed against another nonce"
        );
        assert_eq!(
            check_proof(&key, &n, 1, peers, &prove(&key, &n, 2, 3)),
            Err(HandshakeError::WrongNode { to: 3, me: 1 })
        );
        for from in [1, 4, 0] {
            assert_eq!(
                check_proof(&key, &n, 1, peers, &prove(&key, &n, from, 1)),
                Err(HandshakeError::UnknownPeer(from))
            );
        }
        // A proof from 2 rewritten to say 3 (the MAC covers `from`).
        let mut p = prove(&key, &n, 2, 1);
        p[5..13].copy_from_slice(&3u64.to_le_bytes());
        assert_eq!(
            check_proof(&key, &n, 1, peers, &p),
            Err(HandshakeError::BadProof(3))
        );
        // Any single bit flipped anywhere is refused.
        let good = prove(&key, &n, 2, 1);
        for i in 0..PROOF_BYTES {
            for bit in 0..8 {
                let mut p = good;
                p[i] ^= 1 << bit;
                assert!(
                    check_proof(&key, &n, 1, peers, &p).is_err(),
                    "byte {i} bit {bit}"
                );
            }
        }
        let mut p = good;
        p[4] = WIRE_VERSION + 1;
        assert_eq!(
            check_proof(&key, &n, 1, peers, &p),
            Err(HandshakeError::Version(WIRE_VERSION + 1))
        );
    }

    #[test]
    fn the_listener_proves_itself_too() {
        let key = PeerKey::from_secret(b"s3cret");
        let n = nonce();
        let a = accept(&key, &n, 2, 1);
        assert_eq!(check_accept(&key, &n, 2, 1, &a), Ok(()));
        let bad = Err(HandshakeError::BadAccept(1));
        let other = PeerKey::from_secret(b"other");
        assert_eq!(check_accept(&other, &n, 2, 1, &a), bad, "another secret");
        assert_eq!(check_accept(&key, &nonce(), 2, 1, &a), bad, "another nonce");
        assert_eq!(check_accept(&key, &n, 3, 1, &a), bad, "for another dialer");
        // The dialer's own proof sent back is no acceptance.
        let p = prove(&key, &n, 2, 1);
        let mut echoed = [0u8; ACCEPT_BYTES];
        echoed.copy_from_slice(&p[PROOF_BYTES - ACCEPT_BYTES..]);
        assert_eq!(check_accept(&key, &n, 2, 1, &echoed), bad);
        echoed[..4].copy_from_slice(b"FXRA");
        assert_eq!(check_accept(&key, &n, 2, 1, &echoed), bad);
        for i in 0..ACCEPT_BYTES {
            let mut a = a;
            a[i] ^= 0x40;
            assert_eq!(check_accept(&key, &n, 2, 1, &a), bad, "byte {i}");
        }
    }

    #[test]
    fn a_challenge_from_something_else_is_refused() {
        let n = nonce();
        let mut c = challenge(&n);
        c[4] = 1;
        assert_eq!(read_challenge(&c), Err(HandshakeError::Version(1)));
        // A frame's first bytes (a length and a CRC) are no challenge.
        let mut c = [0u8; CHALLENGE_BYTES];
        c[..4].copy_from_slice(&100u32.to_le_bytes());
        assert_eq!(read_challenge(&c), Err(HandshakeError::NotFelix));
    }

    #[test]
    fn keys_differ_by_secret_and_do_not_print() {
        assert!(PeerKey::open().is_open());
        assert!(!PeerKey::from_secret(b"x").is_open());
        assert_ne!(PeerKey::from_secret(b"x"), PeerKey::from_secret(b"y"));
        assert_eq!(
            format!("{:?}", PeerKey::from_secret(b"x")),
            "PeerKey(from a secret)"
        );
    }
}
