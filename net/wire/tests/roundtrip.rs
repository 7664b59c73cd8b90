//! Property tests: every message round-trips, partial input asks for more,
//! truncated or mutated input errors without panicking.

mod common;

use bytes::BytesMut;
use common::*;
use felix_wire::*;
use proptest::prelude::*;

/// Feed `frame` one byte at a time: `Ok(None)` until the last byte, then the
/// message, with the buffer left empty.
fn feed_bytewise<T: std::fmt::Debug>(frame: &[u8], decode: Decoder<T>) -> (u64, T) {
    let mut buf = BytesMut::new();
    for (i, b) in frame.iter().enumerate() {
        buf.extend_from_slice(&[*b]);
        match decode(&mut buf, DEFAULT_MAX_FRAME_BYTES).expect("prefix of a valid frame") {
            None => assert!(i + 1 < frame.len(), "complete frame not decoded"),
            Some(got) => {
                assert_eq!(i + 1, frame.len(), "decoded before the frame was complete");
                assert!(buf.is_empty());
                return got;
            }
        }
    }
    panic!("frame never decoded");
}

/// Every strict prefix of a valid frame, with its length field rewritten to
/// match, must be rejected: either as a bad frame length (fatal, nothing
/// consumed) or as a body error that consumed exactly the prefix. Except
/// `whole`: the frame without its trailing optional field, itself valid.
fn check_truncations(frame: &[u8], whole: Option<usize>) {
    for cut in (4..frame.len()).filter(|c| Some(*c) != whole) {
        let mut bytes = frame[..cut].to_vec();
        bytes[..4].copy_from_slice(&((cut - 4) as u32).to_le_bytes());
        let (req, resp) = check_decoder_contract(&bytes, DEFAULT_MAX_FRAME_BYTES);
        let expected_fatal = cut < FRAME_HEADER_BYTES;
        for outcome in [req, resp] {
            match outcome {
                Outcome::Fatal => assert!(expected_fatal, "cut {cut}: {outcome:?}"),
                Outcome::BodyError { consumed } => {
                    assert!(!expected_fatal);
                    assert_eq!(consumed, cut);
                }
                other => panic!("truncated frame (cut at {cut}) gave {other:?}"),
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn a_publish_frame_fits_its_size_hint(id in any::<u64>(), req in request()) {
        let buf = encode_req(id, &req);
        if matches!(req, Request::Publish { .. }) {
            prop_assert!(buf.len() <= req.frame_size_hint(), "{} > {}", buf.len(), req.frame_size_hint());
            prop_assert!(req.frame_size_hint() - buf.len() <= 256);
        }
    }

    #[test]
    fn request_round_trip(id in any::<u64>(), req in request()) {
        let mut buf = encode_req(id, &req);
        let header = peek_header(&buf).unwrap();
        prop_assert_eq!(header.frame_bytes(), buf.len());
        prop_assert_eq!(header.kind, KIND_REQUEST);
        prop_assert_eq!(header.opcode, req.opcode());
        prop_assert_eq!(Request::name_of(req.opcode()), Some(req.name()));
        let got = decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES).unwrap();
        prop_assert_eq!(got, Some((id, req)));
        prop_assert!(buf.is_empty());
    }

    /// `DeadLetterInfo::wire_size` is what a dead letter takes in a frame.
    #[test]
    fn dead_letter_wire_size(letters in proptest::collection::vec(dead_letter(), 0..4)) {
        let want: usize = letters
            .iter()
            .map(|d| DeadLetterInfo::wire_size(d.reason.as_deref()))
            .sum();
        let frame = encode_resp(1, &Response::DeadLetters(letters));
        prop_assert_eq!(frame.len(), FRAME_HEADER_BYTES + 4 + want);
    }

    /// `Record::framing_bytes` and `GroupRecord::framing_bytes` with what
    /// the records carry, and the answers' fixed bytes, are what a read's
    /// or a poll's answer takes in a frame: what the broker fills a frame
    /// by.
    #[test]
    fn record_answer_sizes(
        records in proptest::collection::vec(record(), 0..4),
        claimed in proptest::collection::vec(group_record(), 0..4),
    ) {
        fn carried(key: &Option<bytes::Bytes>, headers: &felix_wire::Headers, payload: &[u8]) -> usize {
            key.as_ref().map_or(0, |k| k.len())
                + headers.iter().map(|(n, v)| n.len() + v.len()).sum::<usize>()
                + payload.len()
        }
        let want: usize = records
            .iter()
            .map(|r| Record::framing_bytes(r.key.is_some(), r.headers.len()) + carried(&r.key, &r.headers, &r.payload))
            .sum();
        let frame = encode_resp(1, &Response::Records {
            start_offset: 0,
            next_offset: 0,
            end_offset: 0,
            records,
        });
        prop_assert_eq!(frame.len(), FRAME_HEADER_BYTES + Response::RECORDS_FIXED_BYTES + want);
        let want: usize = claimed
            .iter()
            .map(|r| {
                GroupRecord::framing_bytes(r.key.is_some(), r.headers.len(), r.skipped_before.is_some())
                    + carried(&r.key, &r.headers, &r.payload)
            })
            .sum();
        let frame = encode_resp(1, &Response::GroupRecords { records: claimed });
        prop_assert_eq!(frame.len(), FRAME_HEADER_BYTES + Response::GROUP_RECORDS_FIXED_BYTES + want);
    }

    #[test]
    fn response_round_trip(id in any::<u64>(), resp in response()) {
        let mut buf = encode_resp(id, &resp);
        let header = peek_header(&buf).unwrap();
        prop_assert_eq!(header.frame_bytes(), buf.len());
        prop_assert_eq!(header.kind, KIND_RESPONSE);
        prop_assert_eq!(header.opcode, resp.opcode());
        let got = decode_response(&mut buf, DEFAULT_MAX_FRAME_BYTES).unwrap();
        prop_assert_eq!(got, Some((id, resp)));
        prop_assert!(buf.is_empty());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn request_bytewise(id in any::<u64>(), req in request()) {
        let frame = encode_req(id, &req);
        prop_assert_eq!(feed_bytewise(&frame, decode_request), (id, req));
    }

    #[test]
    fn response_bytewise(id in any::<u64>(), resp in response()) {
        let frame = encode_resp(id, &resp);
        prop_assert_eq!(feed_bytewise(&frame, decode_response), (id, resp));
    }

    /// Several frames back to back in one buffer decode in order.
    #[test]
    fn pipelined_frames(reqs in proptest::collection::vec(request(), 1..6)) {
        let mut buf = BytesMut::new();
        for (i, r) in reqs.iter().enumerate() {
            encode_request(i as u64, r, &mut buf);
        }
        for (i, r) in reqs.iter().enumerate() {
            let got = decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES).unwrap();
            prop_assert_eq!(got, Some((i as u64, r.clone())));
        }
        prop_assert_eq!(decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES).unwrap(), None);
    }

    /// Raw prefixes (length field intact) always ask for more and consume
    /// nothing.
    #[test]
    fn prefixes_need_more(id in any::<u64>(), req in request(), resp in response()) {
        for frame in [encode_req(id, &req), encode_resp(id, &resp)] {
            for cut in 0..frame.len() {
                let (a, b) = check_decoder_contract(&frame[..cut], DEFAULT_MAX_FRAME_BYTES);
                prop_assert_eq!(a, Outcome::NeedMore);
                prop_assert_eq!(b, Outcome::NeedMore);
            }
        }
    }

    /// Prefixes presented as complete frames (length rewritten) are errors.
    #[test]
    fn truncated_bodies_error(id in any::<u64>(), req in request(), resp in response()) {
        // The stream incarnation trails (a u64), and may be left out.
        let trailing = |present: bool, frame: &[u8]| present.then(|| frame.len() - 8);
        let r = encode_req(id, &req);
        let present = matches!(req, Request::CreateStream { incarnation: Some(_), .. });
        check_truncations(&r, trailing(present, &r));
        let r = encode_resp(id, &resp);
        let present = matches!(&resp, Response::Stream(i) if i.incarnation.is_some());
        // So does an error's not_applied (one byte).
        let whole = match &resp {
            Response::Error(e) if e.not_applied => Some(r.len() - 1),
            _ => trailing(present, &r),
        };
        check_truncations(&r, whole);
    }

    /// Overwriting random bytes never panics, and whatever the decoder
    /// makes of the result obeys the buffer contract.
    #[test]
    fn mutations_never_panic(
        id in any::<u64>(),
        req in request(),
        resp in response(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        for frame in [encode_req(id, &req), encode_resp(id, &resp)] {
            let mut bytes = frame.to_vec();
            for (at, v) in &edits {
                let i = at.index(bytes.len());
                bytes[i] = *v;
            }
            check_decoder_contract(&bytes, DEFAULT_MAX_FRAME_BYTES);
            // Also with the length field left pointing at the original size
            // but the body shifted by a dropped byte.
            if bytes.len() > FRAME_HEADER_BYTES {
                let mut short = bytes.clone();
                short.remove(FRAME_HEADER_BYTES);
                check_decoder_contract(&short, DEFAULT_MAX_FRAME_BYTES);
            }
        }
    }
}
