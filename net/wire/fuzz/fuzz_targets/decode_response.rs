//! Feed arbitrary bytes to `decode_response` as a read loop would: decode
//! frames until the decoder asks for more or hits a fatal error. Anything
//! that decodes must re-encode to a frame that decodes to the same value.
#![no_main]

use bytes::BytesMut;
use felix_wire::{decode_response, encode_response};
use libfuzzer_sys::fuzz_target;

/// Small cap so length checks are exercised without huge inputs.
const MAX_FRAME_BYTES: u32 = 64 * 1024;

fuzz_target!(|data: &[u8]| {
    let mut buf = BytesMut::from(data);
    loop {
        let before = buf.len();
        match decode_response(&mut buf, MAX_FRAME_BYTES) {
            Ok(None) => {
                assert_eq!(buf.len(), before, "Ok(None) consumed bytes");
                break;
            }
            Ok(Some((id, msg))) => {
                assert!(buf.len() < before, "a decoded frame consumed nothing");
                let mut out = BytesMut::new();
                encode_response(id, &msg, &mut out);
                let again = decode_response(&mut out, u32::MAX).expect("re-encoded frame decodes");
                assert_eq!(again, Some((id, msg)));
                assert!(out.is_empty());
            }
            Err(e) if e.request_id().is_some() => {
                // Body error: the frame was consumed and the stream goes on.
                assert!(buf.len() < before, "a body error consumed nothing");
                let _ = e.to_wire_error();
            }
            Err(_) => {
                assert_eq!(buf.len(), before, "a fatal error consumed bytes");
                break;
            }
        }
    }
});
