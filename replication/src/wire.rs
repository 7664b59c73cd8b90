//! Replication traffic between brokers, framed by Felix.
//!
//! A connection carries these frames one way, from the broker that dialed,
//! after a [`handshake`](crate::handshake) in which the dialer proved who
//! it is.
//!
//! raft-rs's messages are protobuf types, but only in memory: what crosses
//! the network is this frame, so no protobuf parser ever reads bytes from a
//! peer. A frame carries every message one core has for one peer core in
//! one pass (heartbeats and appends of many shards together), each tagged
//! with the replica group (shard) it belongs to.
//!
//! ```text
//! frame    len u32 | crc u32 | version u8 | count u16 | message * count
//!          len: bytes after itself; crc: CRC32C of everything after it
//! message  group u64 | held_by_all u64 | type u8 | flags u8 | to from
//!          term log_term index commit commit_term reject_hint
//!          request_snapshot: u64 * 9 |
//!          priority i64 | context_len u16 | context | entry_count u32 |
//!          entry * entry_count
//! entry    term u64 | index u64 | data_len u32 | data
//! ```
//!
//! All integers little-endian. `held_by_all` is Felix's, not Raft's: an
//! index the sender knows every replica of the group holds (a leader's
//! count of its followers' acknowledged entries), below which each
//! replica compacts its log (0 when unknown). `flags` bit 0 is `reject`. Only the message
//! types replicas exchange are framed: appends, heartbeats, votes and
//! pre-votes and their responses (no snapshots yet; leadership transfer and
//! forwarded reads are not used),
//! and entries are normal entries without their own context. Decoding
//! checks every length against the bytes that are there before using it,
//! never panics, and hands out entry data as slices of the frame (no copy).

use bytes::{Buf, Bytes};
use raft::eraftpb::{Entry, EntryType, Message, MessageType};

pub const WIRE_VERSION: u8 = 3;
/// Bytes before the first message: len, crc, version, count.
pub const FRAME_HEADER_BYTES: usize = 4 + 4 + 1 + 2;
const MESSAGE_FIXED_BYTES: usize = 8 + 8 + 1 + 1 + 9 * 8 + 8 + 2 + 4;
const ENTRY_FIXED_BYTES: usize = 8 + 8 + 4;
/// Most messages in one frame.
pub const FRAME_MAX_MESSAGES: usize = u16::MAX as usize;

/// A raft message for one replica group.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerMessage {
    /// The replica group (shard) it belongs to.
    pub group: u64,
    /// An index every replica of the group holds, as far as the sender
    /// knows ([`crate::replica::Replica::compact_hint`]); 0 when unknown.
    pub held_by_all: u64,
    pub message: Message,
}

/// Why bytes are not a frame, or a message cannot be framed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("frame of {len} bytes is over the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    #[error("frame checksum {stored:#010x} does not match {computed:#010x}")]
    Checksum { stored: u32, computed: u32 },
    #[error("replication wire version {0} is not supported (this build speaks {WIRE_VERSION})")]
    Version(u8),
    #[error("frame is malformed: {0}")]
    Malformed(&'static str),
    #[error("message type {0} is not sent between replicas")]
    MessageType(u8),
    #[error("cannot frame this message: {0}")]
    Unframeable(&'static str),
}

/// The message types replicas exchange, and so the only ones framed:
/// appends, heartbeats, votes and pre-votes, and their responses.
pub const PEER_MESSAGE_TYPES: [MessageType; 8] = [
    MessageType::MsgAppend,
    MessageType::MsgAppendResponse,
    MessageType::MsgRequestVote,
    MessageType::MsgRequestVoteResponse,
    MessageType::MsgHeartbeat,
    MessageType::MsgHeartbeatResponse,
    MessageType::MsgRequestPreVote,
    MessageType::MsgRequestPreVoteResponse,
];

/// On the wire a type is raft-rs's own number for it.
fn type_code(t: MessageType) -> Option<u8> {
    PEER_MESSAGE_TYPES.contains(&t).then_some(t as u8)
}

fn type_from(code: u8) -> Option<MessageType> {
    PEER_MESSAGE_TYPES.into_iter().find(|&t| t as u8 == code)
}

/// Bytes `m` takes in a frame (without the frame's header).
pub fn framed_len(m: &Message) -> usize {
    MESSAGE_FIXED_BYTES
        + m.context.len()
        + m.get_entries()
            .iter()
            .map(|e| ENTRY_FIXED_BYTES + e.data.len())
            .sum::<usize>()
}

/// Append one frame holding `messages` to `out`. Refuses (and appends
/// nothing) a message of a type peers do not exchange, one carrying a
/// snapshot, an entry that is not normal or has a context, or a frame of
/// more than `max_frame` bytes.
pub fn encode_frame(
    messages: &[PeerMessage],
    max_frame: usize,
    out: &mut Vec<u8>,
) -> Result<(), WireError> {
    if messages.len() > FRAME_MAX_MESSAGES {
        return Err(WireError::Unframeable("too many messages for one frame"));
    }
    let mut len = FRAME_HEADER_BYTES;
    for pm in messages {
        let m = &pm.message;
        type_code(m.get_msg_type()).ok_or(WireError::Unframeable("not a peer message type"))?;
        if m.snapshot.is_some() {
            return Err(WireError::Unframeable("snapshots are not supported yet"));
        }
        if m.context.len() > u16::MAX as usize {
            return Err(WireError::Unframeable("message context over 64 KiB"));
        }
        len += MESSAGE_FIXED_BYTES + m.context.len();
        for e in m.get_entries() {
            if e.get_entry_type() != EntryType::EntryNormal || !e.context.is_empty() {
                return Err(WireError::Unframeable(
                    "only normal entries without context are framed",
                ));
            }
            if e.data.len() > u32::MAX as usize {
                return Err(WireError::Unframeable("entry over 4 GiB"));
            }
            len += ENTRY_FIXED_BYTES + e.data.len();
        }
    }
    let max_frame = max_frame.min(u32::MAX as usize);
    if len > max_frame {
        return Err(WireError::TooLarge {
            len,
            max: max_frame,
        });
    }
    out.reserve(len);
    let start = out.len();
    out.extend_from_slice(&((len - 4) as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.push(WIRE_VERSION);
    out.extend_from_slice(&(messages.len() as u16).to_le_bytes());
    for pm in messages {
        let m = &pm.message;
        out.extend_from_slice(&pm.group.to_le_bytes());
        out.extend_from_slice(&pm.held_by_all.to_le_bytes());
        out.push(type_code(m.get_msg_type()).expect("checked above"));
        out.push(m.reject as u8);
        for v in [
            m.to,
            m.from,
            m.term,
            m.log_term,
            m.index,
            m.commit,
            m.commit_term,
            m.reject_hint,
            m.request_snapshot,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&m.priority.to_le_bytes());
        out.extend_from_slice(&(m.context.len() as u16).to_le_bytes());
        out.extend_from_slice(&m.context);
        out.extend_from_slice(&(m.get_entries().len() as u32).to_le_bytes());
        for e in m.get_entries() {
            out.extend_from_slice(&e.term.to_le_bytes());
            out.extend_from_slice(&e.index.to_le_bytes());
            out.extend_from_slice(&(e.data.len() as u32).to_le_bytes());
            out.extend_from_slice(&e.data);
        }
    }
    debug_assert_eq!(out.len() - start, len);
    let crc = crc32c::crc32c(&out[start + 8..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// How long the frame at the start of `buf` is, once its first four bytes
/// are there (`None` before): lets a reader refuse an oversized frame before
/// buffering it.
pub fn frame_len(buf: &[u8], max_frame: usize) -> Result<Option<usize>, WireError> {
    let Some(len) = buf.get(..4) else {
        return Ok(None);
    };
    let len = u32::from_le_bytes(len.try_into().expect("four bytes")) as usize + 4;
    if len > max_frame {
        return Err(WireError::TooLarge {
            len,
            max: max_frame,
        });
    }
    if len < FRAME_HEADER_BYTES {
        return Err(WireError::Malformed("frame shorter than its header"));
    }
    Ok(Some(len))
}

/// Decode the frame at the start of `buf`: `Ok(None)` if it is not all
/// there yet, else its messages and the bytes it took.
pub fn decode_frame(
    buf: &Bytes,
    max_frame: usize,
) -> Result<Option<(Vec<PeerMessage>, usize)>, WireError> {
    let Some(len) = frame_len(buf, max_frame)? else {
        return Ok(None);
    };
    if buf.len() < len {
        return Ok(None);
    }
    let stored = u32::from_le_bytes(buf[4..8].try_into().expect("four bytes"));
    let computed = crc32c::crc32c(&buf[8..len]);
    if stored != computed {
        return Err(WireError::Checksum { stored, computed });
    }
    if buf[8] != WIRE_VERSION {
        return Err(WireError::Version(buf[8]));
    }
    let mut r = buf.slice(9..len);
    let count = take_u16(&mut r)? as usize;
    // Every message takes at least its fixed part: a count the bytes cannot
    // hold is refused before anything is allocated for it.
    if count > r.len() / MESSAGE_FIXED_BYTES {
        return Err(WireError::Malformed("more messages than bytes"));
    }
    let mut messages = Vec::with_capacity(count);
    for _ in 0..count {
        messages.push(take_message(&mut r)?);
    }
    if !r.is_empty() {
        return Err(WireError::Malformed("bytes after the last message"));
    }
    Ok(Some((messages, len)))
}

fn need(r: &Bytes, n: usize) -> Result<(), WireError> {
    if r.len() < n {
        Err(WireError::Malformed("truncated"))
    } else {
        Ok(())
    }
}

fn take_u16(r: &mut Bytes) -> Result<u16, WireError> {
    need(r, 2)?;
    Ok(r.get_u16_le())
}

fn take_u32(r: &mut Bytes) -> Result<u32, WireError> {
    need(r, 4)?;
    Ok(r.get_u32_le())
}

fn take_u64(r: &mut Bytes) -> Result<u64, WireError> {
    need(r, 8)?;
    Ok(r.get_u64_le())
}

fn take_bytes(r: &mut Bytes, n: usize) -> Result<Bytes, WireError> {
    need(r, n)?;
    Ok(r.split_to(n))
}

fn take_message(r: &mut Bytes) -> Result<PeerMessage, WireError> {
    need(r, MESSAGE_FIXED_BYTES)?;
    let group = r.get_u64_le();
    let held_by_all = r.get_u64_le();
    let code = r.get_u8();
    let msg_type = type_from(code).ok_or(WireError::MessageType(code))?;
    let flags = r.get_u8();
    if flags & !1 != 0 {
        return Err(WireError::Malformed("unknown message flags"));
    }
    let mut m = Message::default();
    m.set_msg_type(msg_type);
    m.reject = flags & 1 != 0;
    m.to = r.get_u64_le();
    m.from = r.get_u64_le();
    m.term = r.get_u64_le();
    m.log_term = r.get_u64_le();
    m.index = r.get_u64_le();
    m.commit = r.get_u64_le();
    m.commit_term = r.get_u64_le();
    m.reject_hint = r.get_u64_le();
    m.request_snapshot = r.get_u64_le();
    m.priority = r.get_i64_le();
    let context_len = r.get_u16_le() as usize;
    m.context = take_bytes(r, context_len)?;
    let entries = take_u32(r)? as usize;
    if entries > r.len() / ENTRY_FIXED_BYTES {
        return Err(WireError::Malformed("more entries than bytes"));
    }
    let mut list = Vec::with_capacity(entries);
    for _ in 0..entries {
        let term = take_u64(r)?;
        let index = take_u64(r)?;
        let data_len = take_u32(r)? as usize;
        let data = take_bytes(r, data_len)?;
        list.push(Entry {
            term,
            index,
            data,
            ..Entry::default()
        });
    }
    m.entries = list.into();
    Ok(PeerMessage {
        group,
        held_by_all,
        message: m,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    const MAX: usize = 1 << 20;

    fn random_message(rng: &mut SmallRng) -> PeerMessage {
        let mut m = Message::default();
        m.set_msg_type(PEER_MESSAGE_TYPES[rng.gen_range(0..PEER_MESSAGE_TYPES.len())]);
        m.to = rng.gen();
        m.from = rng.gen();
        m.term = rng.gen();
        m.log_term = rng.gen();
        m.index = rng.gen();
        m.commit = rng.gen();
        m.commit_term = rng.gen();
        m.reject = rng.gen();
        m.reject_hint = rng.gen();
        m.request_snapshot = rng.gen();
        m.priority = rng.gen();
        let ctx: Vec<u8> = (0..rng.gen_range(0..12)).map(|_| rng.gen()).collect();
        m.context = ctx.into();
        let entries: Vec<Entry> = (0..rng.gen_range(0..5))
            .map(|_| Entry {
                term: rng.gen(),
                index: rng.gen(),
                data: (0..rng.gen_range(0..300))
                    .map(|_| rng.gen())
                    .collect::<Vec<u8>>()
                    .into(),
                ..Entry::default()
            })
            .collect();
        m.entries = entries.into();
        PeerMessage {
            group: rng.gen(),
            held_by_all: rng.gen(),
            message: m,
        }
    }

    #[test]
    fn every_message_round_trips() {
        let mut rng = SmallRng::seed_from_u64(1);
        for _ in 0..2_000 {
            let msgs: Vec<PeerMessage> = (0..rng.gen_range(0..6))
                .map(|_| random_message(&mut rng))
                .collect();
            let mut out = vec![0xAA]; // frames append after what is there
            encode_frame(&msgs, MAX, &mut out).unwrap();
            let buf = Bytes::from(out).slice(1..);
            let (back, used) = decode_frame(&buf, MAX).unwrap().unwrap();
            assert_eq!(used, buf.len());
            assert_eq!(back, msgs);
        }
    }

    #[test]
    fn a_partial_frame_waits_and_two_frames_decode_one_at_a_time() {
        let mut rng = SmallRng::seed_from_u64(2);
        let a = vec![random_message(&mut rng)];
        let b = vec![random_message(&mut rng), random_message(&mut rng)];
        let mut out = Vec::new();
        encode_frame(&a, MAX, &mut out).unwrap();
        let first = out.len();
        encode_frame(&b, MAX, &mut out).unwrap();
        let all = Bytes::from(out);
        for cut in 0..first {
            assert_eq!(decode_frame(&all.slice(..cut), MAX).unwrap(), None);
        }
        let (got, used) = decode_frame(&all, MAX).unwrap().unwrap();
        assert_eq!((got, used), (a, first));
        let (got, _) = decode_frame(&all.slice(first..), MAX).unwrap().unwrap();
        assert_eq!(got, b);
    }

    #[test]
    fn oversized_corrupt_and_unframeable_are_refused() {
        let mut rng = SmallRng::seed_from_u64(3);
        let msgs = vec![random_message(&mut rng)];
        let mut out = Vec::new();
        encode_frame(&msgs, MAX, &mut out).unwrap();
        // Refused on the length alone, before the rest arrives.
        assert!(matches!(
            frame_len(&out[..4], 16),
            Err(WireError::TooLarge { .. })
        ));
        // A flipped bit anywhere after the length.
        for i in 4..out.len() {
            let mut bad = out.clone();
            bad[i] ^= 0x10;
            assert!(decode_frame(&Bytes::from(bad), MAX).is_err(), "byte {i}");
        }
        // Types peers do not exchange, snapshots, entries with a context.
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgPropose);
        let local = PeerMessage {
            group: 1,
            held_by_all: 0,
            message: m,
        };
        assert!(encode_frame(&[local], MAX, &mut Vec::new()).is_err());
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgSnapshot);
        let snap = PeerMessage {
            group: 1,
            held_by_all: 0,
            message: m,
        };
        assert!(encode_frame(&[snap], MAX, &mut Vec::new()).is_err());
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgAppend);
        m.entries = vec![Entry {
            context: Bytes::from_static(b"x"),
            ..Entry::default()
        }]
        .into();
        let with_ctx = PeerMessage {
            group: 1,
            held_by_all: 0,
            message: m,
        };
        let mut untouched = vec![1, 2, 3];
        assert!(encode_frame(&[with_ctx], MAX, &mut untouched).is_err());
        assert_eq!(untouched, vec![1, 2, 3]);
        // Too big for the limit.
        assert!(matches!(
            encode_frame(&msgs, 32, &mut Vec::new()),
            Err(WireError::TooLarge { .. })
        ));
    }

    /// A frame with a valid checksum around garbage: the checksum is no
    /// defence against a peer that computes it, so the parser must hold.
    fn seal(body: &[u8]) -> Bytes {
        let mut out = Vec::new();
        out.extend_from_slice(&((body.len() + 4) as u32).to_le_bytes());
        out.extend_from_slice(&crc32c::crc32c(body).to_le_bytes());
        out.extend_from_slice(body);
        Bytes::from(out)
    }

    #[test]
    fn arbitrary_bytes_with_a_valid_checksum_never_panic_or_overallocate() {
        let mut rng = SmallRng::seed_from_u64(4);
        let mut valid = Vec::new();
        encode_frame(&[random_message(&mut rng)], MAX, &mut valid).unwrap();
        for _ in 0..20_000 {
            let mut body: Vec<u8> = if rng.gen_bool(0.5) {
                valid[8..].to_vec()
            } else {
                let mut b = vec![WIRE_VERSION];
                b.extend((0..rng.gen_range(0..200)).map(|_| rng.gen::<u8>()));
                b
            };
            for _ in 0..rng.gen_range(0..4) {
                if !body.is_empty() {
                    let i = rng.gen_range(0..body.len());
                    body[i] = rng.gen();
                }
            }
            body.truncate(rng.gen_range(0..=body.len()));
            let _ = decode_frame(&seal(&body), MAX);
        }
        // Counts far past the bytes are refused, not allocated for.
        let mut body = vec![WIRE_VERSION];
        body.extend_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(
            decode_frame(&seal(&body), MAX),
            Err(WireError::Malformed("more messages than bytes"))
        );
    }
}
