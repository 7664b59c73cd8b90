//! Decoding hostile frames must not allocate more than the bytes that
//! arrived. A counting global allocator records the largest single
//! allocation made on the current thread while a decoder runs.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use bytes::{BufMut, BytesMut};
use felix_wire::*;

struct Counting;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: defers to the system allocator; only records sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

fn note(size: usize) {
    // try_with: the thread-local may already be gone during thread teardown.
    let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Largest single allocation made while running `f`.
fn largest_alloc<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|l| l.set(0));
    let out = f();
    (out, LARGEST.with(|l| l.get()))
}

fn frame(opcode: u8, body: &[u8]) -> BytesMut {
    let mut b = BytesMut::new();
    b.put_u32_le(12 + body.len() as u32);
    b.put_u8(KIND_REQUEST);
    b.put_u8(opcode);
    b.put_u16_le(0);
    b.put_u64_le(1);
    b.put_slice(body);
    b
}

#[test]
fn huge_counts_allocate_nothing_big() {
    // Publish: stream t/n/s, shard target 0, default ack, 4e9 records, 10 bytes.
    let mut body = BytesMut::new();
    for _ in 0..3 {
        body.put_u16_le(1);
        body.put_u8(b'x');
    }
    body.put_u8(0);
    body.put_u32_le(0);
    body.put_u8(0);
    body.put_u32_le(u32::MAX);
    body.put_slice(&[0; 10]);
    let mut buf = frame(opcodes::request::PUBLISH, &body);
    let (res, largest) = largest_alloc(|| decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES));
    assert!(res.is_err());
    assert!(largest < 1024, "largest allocation {largest} bytes");
}

#[test]
fn over_limit_frames_allocate_nothing() {
    let mut buf = BytesMut::from(&u32::MAX.to_le_bytes()[..]);
    let (res, largest) = largest_alloc(|| decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES));
    assert!(matches!(res, Err(DecodeError::TooLarge { .. })));
    assert_eq!(largest, 0);

    // Under the limit but not yet arrived: nothing is reserved either.
    let mut buf = BytesMut::from(&(DEFAULT_MAX_FRAME_BYTES).to_le_bytes()[..]);
    let (res, largest) = largest_alloc(|| decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES));
    assert_eq!(res, Ok(None));
    assert_eq!(largest, 0);
}

/// A publish of `records` to t/n/s shard 0, and its encoded frame.
fn publish_frame(records: Vec<RecordIn>) -> (Request, BytesMut) {
    let req = Request::Publish {
        stream: StreamRef::new("t", "n", "s"),
        target: PublishTarget::Shard(0),
        ack: AckMode::Default,
        records: records.into(),
    };
    let mut buf = BytesMut::new();
    encode_request(1, &req, &mut buf);
    (req, buf)
}

#[test]
fn a_publish_decodes_in_place() {
    // 1000 records of 1 KiB: the records are a checked view of the frame,
    // so the decoder allocates only the stream's names (no vector of
    // records, no copies of payloads).
    let records: Vec<RecordIn> = (0..1000)
        .map(|i| RecordIn {
            payload: vec![i as u8; 1024].into(),
            ..RecordIn::default()
        })
        .collect();
    let (req, mut buf) = publish_frame(records);
    let (res, largest) = largest_alloc(|| decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES));
    let decoded = res.unwrap().unwrap().1;
    assert_eq!(decoded, req);
    assert!(largest < 64, "largest allocation {largest} bytes");
    assert_eq!(decoded.decoded_overhead(), 0);
}

/// A frame of records with many empty headers (twenty thousand headers in
/// ~120 KB): decoded, it takes no memory beyond the frame, where decoding
/// into owned records took several times the frame. The producer's owned
/// request reports what its vectors hold.
#[test]
fn empty_headers_cost_nothing_decoded() {
    let headers: Vec<(String, bytes::Bytes)> = (0..1000)
        .map(|_| (String::new(), bytes::Bytes::new()))
        .collect();
    let records: Vec<RecordIn> = (0..20)
        .map(|_| RecordIn {
            headers: headers.clone(),
            ..RecordIn::default()
        })
        .collect();
    let (req, mut buf) = publish_frame(records);
    let frame_len = buf.len();
    let header_vec = 1000 * std::mem::size_of::<(String, bytes::Bytes)>();
    assert_eq!(
        req.decoded_overhead(),
        20 * header_vec + 20 * std::mem::size_of::<RecordIn>()
    );
    assert!(req.decoded_overhead() > 5 * frame_len);
    let (res, largest) = largest_alloc(|| decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES));
    let decoded = res.unwrap().unwrap().1;
    assert_eq!(decoded, req);
    assert!(largest < 64, "largest allocation {largest} bytes");
    assert_eq!(decoded.decoded_overhead(), 0);
    let Request::Publish { records, .. } = &decoded else {
        panic!("not a publish")
    };
    assert!(records.iter().all(|r| r.headers.len() == 1000));
}
