//! Frame header, and the encode/decode entry points used by read and write
//! loops on both sides.
//!
//! ```text
//! u32 len | u8 kind | u8 opcode | u16 flags | u64 request_id | body
//! ```
//!
//! `len` counts every byte after itself (header remainder plus body).

use bytes::{BufMut, BytesMut};

use crate::codec::Reader;
use crate::error::DecodeError;
use crate::message::{Request, Response};
use crate::FRAME_HEADER_BYTES;

/// Frame kind of a client-to-broker request.
pub const KIND_REQUEST: u8 = 1;
/// Frame kind of a broker-to-client response.
pub const KIND_RESPONSE: u8 = 2;

/// Bytes counted by `len` that belong to the header.
const HEADER_AFTER_LEN: u32 = (FRAME_HEADER_BYTES - 4) as u32;

/// The fixed 16-byte header in front of every frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Bytes after the length field: 12 header bytes plus the body.
    pub len: u32,
    pub kind: u8,
    pub opcode: u8,
    /// Reserved; 0 in protocol version 1.
    pub flags: u16,
    pub request_id: u64,
}

impl FrameHeader {
    /// Parse the header at the start of `buf`, if 16 bytes are there. Does
    /// not validate anything.
    pub fn parse(buf: &[u8]) -> Option<FrameHeader> {
        let h: &[u8; FRAME_HEADER_BYTES] = buf.get(..FRAME_HEADER_BYTES)?.try_into().ok()?;
        Some(FrameHeader {
            len: u32::from_le_bytes([h[0], h[1], h[2], h[3]]),
            kind: h[4],
            opcode: h[5],
            flags: u16::from_le_bytes([h[6], h[7]]),
            request_id: u64::from_le_bytes([h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]]),
        })
    }

    /// Whole frame size, length field included.
    pub fn frame_bytes(&self) -> usize {
        4 + self.len as usize
    }

    /// Body size, or `None` if `len` is too short to hold the header.
    pub fn body_bytes(&self) -> Option<usize> {
        self.len.checked_sub(HEADER_AFTER_LEN).map(|b| b as usize)
    }
}

/// The header at the start of `buf`, if 16 bytes have arrived. A read loop
/// may use it to reserve buffer space for a large frame once it has checked
/// `len` against its limit.
pub fn peek_header(buf: &[u8]) -> Option<FrameHeader> {
    FrameHeader::parse(buf)
}

/// Encode a request frame, appending to `out`.
///
/// Encoding does not check the peer's `max_frame_bytes`; a client should
/// compare the bytes appended with the limit from `HelloOk` before sending.
/// Strings longer than 65535 bytes are truncated (at a character boundary).
///
/// # Panics
/// If the frame would be 4 GiB or more.
pub fn encode_request(request_id: u64, req: &Request, out: &mut BytesMut) {
    let start = begin_frame(out, KIND_REQUEST, req.opcode(), request_id);
    req.encode_body(out);
    finish_frame(out, start);
}

/// Encode a response frame, appending to `out`. See [`encode_request`].
///
/// # Panics
/// If the frame would be 4 GiB or more.
pub fn encode_response(request_id: u64, resp: &Response, out: &mut BytesMut) {
    let start = begin_frame(out, KIND_RESPONSE, resp.opcode(), request_id);
    resp.encode_body(out);
    finish_frame(out, start);
}

fn begin_frame(out: &mut BytesMut, kind: u8, opcode: u8, request_id: u64) -> usize {
    let start = out.len();
    out.put_u32_le(0); // patched by finish_frame
    out.put_u8(kind);
    out.put_u8(opcode);
    out.put_u16_le(0);
    out.put_u64_le(request_id);
    start
}

fn finish_frame(out: &mut BytesMut, start: usize) {
    let len = u32::try_from(out.len() - start - 4)
        .expect("felix-wire: frame of 4 GiB or more cannot be encoded");
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

/// Decode one request frame from the front of `buf`.
///
/// * `Ok(None)`: the frame is not complete yet; `buf` is untouched.
/// * `Ok(Some((request_id, request)))`: the frame was removed from `buf`.
///   Payload [`Bytes`](bytes::Bytes) share `buf`'s allocation (no copy).
/// * `Err(e)` with [`e.request_id()`](DecodeError::request_id) `Some`: the
///   frame was removed from `buf` but its contents were bad; answer that id
///   with [`e.to_wire_error()`](DecodeError::to_wire_error) and continue.
/// * `Err(e)` with `request_id()` `None`: the length prefix is over
///   `max_frame_bytes` or under the header size; nothing was consumed and the
///   connection must be dropped.
pub fn decode_request(
    buf: &mut BytesMut,
    max_frame_bytes: u32,
) -> Result<Option<(u64, Request)>, DecodeError> {
    decode_frame(buf, max_frame_bytes, KIND_REQUEST, Request::decode_body)
}

/// Decode one response frame from the front of `buf`. Same contract as
/// [`decode_request`].
pub fn decode_response(
    buf: &mut BytesMut,
    max_frame_bytes: u32,
) -> Result<Option<(u64, Response)>, DecodeError> {
    decode_frame(buf, max_frame_bytes, KIND_RESPONSE, Response::decode_body)
}

fn decode_frame<T>(
    buf: &mut BytesMut,
    max_frame_bytes: u32,
    kind: u8,
    body: fn(u8, &mut Reader) -> Result<T, DecodeError>,
) -> Result<Option<(u64, T)>, DecodeError> {
    let Some(len) = buf.get(..4) else {
        return Ok(None);
    };
    let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]);
    // Check the declared length before waiting for (or allocating) anything,
    // so a hostile prefix costs the receiver nothing.
    if len > max_frame_bytes {
        return Err(DecodeError::TooLarge {
            declared: len,
            max: max_frame_bytes,
        });
    }
    if len < HEADER_AFTER_LEN {
        return Err(DecodeError::BadValue {
            what: "frame length",
        });
    }
    let total = 4 + len as usize;
    if buf.len() < total {
        return Ok(None);
    }
    // From here on the frame is consumed whatever its contents, so the
    // stream stays in sync and a bad request can be answered by id.
    let frame = buf.split_to(total).freeze();
    let header = FrameHeader::parse(&frame).expect("frame holds at least a header");
    let (id, opcode) = (header.request_id, header.opcode);
    if header.kind != kind {
        return Err(DecodeError::BadKind(header.kind).in_frame(id, opcode));
    }
    if header.flags != 0 {
        return Err(DecodeError::BadValue { what: "flags" }.in_frame(id, opcode));
    }
    let mut r = Reader::new(frame.slice(FRAME_HEADER_BYTES..));
    let msg = body(opcode, &mut r)
        .and_then(|m| r.finish().map(|()| m))
        .map_err(|e| e.in_frame(id, opcode))?;
    Ok(Some((id, msg)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_layout() {
        let mut out = BytesMut::new();
        encode_request(0x0102_0304_0506_0708, &Request::Ping, &mut out);
        assert_eq!(
            &out[..],
            &[12, 0, 0, 0, 1, 0x02, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1][..]
        );
        let h = peek_header(&out).unwrap();
        assert_eq!(h.len, 12);
        assert_eq!(h.body_bytes(), Some(0));
        assert_eq!(h.frame_bytes(), 16);
    }

    #[test]
    fn appends_after_existing_bytes() {
        let mut out = BytesMut::from(&b"xyz"[..]);
        encode_response(9, &Response::Pong, &mut out);
        assert_eq!(&out[..3], b"xyz");
        let mut rest = out.split_off(3);
        assert_eq!(
            decode_response(&mut rest, 1024).unwrap(),
            Some((9, Response::Pong))
        );
        assert!(rest.is_empty());
    }
}
