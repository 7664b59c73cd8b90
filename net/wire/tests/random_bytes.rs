//! A poor man's fuzzer that runs on stable in CI: ~100k seeded random inputs
//! through both decoders, checking the buffer contract on each. The real
//! fuzz targets live in `net/wire/fuzz/` (cargo-fuzz, nightly).
//!
//! The seed is printed; rerun a failure with `FELIX_WIRE_SEED=<seed>`.

mod common;

use bytes::{BufMut, BytesMut};
use common::*;
use felix_wire::*;
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

/// splitmix64: tiny, seedable, good enough to generate junk.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Up to `max` random bytes.
    fn junk(&mut self, max: u64) -> Vec<u8> {
        let n = self.below(max + 1);
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// Mostly small numbers, sometimes huge: lengths and counts that are
    /// near the truth are what get deep into a body.
    fn small_u32(&mut self) -> u32 {
        match self.below(4) {
            0 => self.next() as u32,
            _ => self.below(8) as u32,
        }
    }
}

const CASES: u64 = 100_000;

#[test]
fn random_bytes_never_break_the_decoders() {
    let seed = std::env::var("FELIX_WIRE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
    println!("random_bytes seed: {seed} (rerun with FELIX_WIRE_SEED={seed})");
    let mut rng = Rng(seed);
    let opcodes: Vec<u8> = Request::all_opcodes()
        .chain([
            0x01, 0x02, 0x03, 0x10, 0x11, 0x12, 0x13, 0x20, 0x21, 0x30, 0x31, 0x32, 0x33, 0x40,
            0x41, 0xFF,
        ])
        .collect();
    // Valid messages come from the proptest strategies, driven by the same
    // seed so a failure replays exactly.
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes),
    );
    let (requests, responses) = (request(), response());
    let mut decoded = 0u64;
    for _ in 0..CASES {
        let input = match rng.below(4) {
            // A valid frame with a few bytes overwritten (or none): gets
            // deep into bodies, past the first field.
            0 => {
                let id = rng.next();
                let mut v = if rng.below(2) == 0 {
                    let req = requests.new_tree(&mut runner).unwrap().current();
                    encode_req(id, &req).to_vec()
                } else {
                    let resp = responses.new_tree(&mut runner).unwrap().current();
                    encode_resp(id, &resp).to_vec()
                };
                for _ in 0..rng.below(4) {
                    let i = rng.below(v.len() as u64) as usize;
                    v[i] = match rng.below(3) {
                        0 => 0,
                        1 => 0xFF,
                        _ => rng.next() as u8,
                    };
                }
                v
            }
            // Pure noise: mostly exercises the framing checks.
            1 => rng.junk(64),
            // A well-formed header with a known opcode and a body built from
            // plausible little integers and noise, to get into the bodies.
            _ => {
                let mut body = BytesMut::new();
                for _ in 0..rng.below(24) {
                    match rng.below(4) {
                        0 => body.put_u8(rng.below(3) as u8),
                        1 => body.put_u16_le(rng.small_u32() as u16),
                        2 => body.put_u32_le(rng.small_u32()),
                        _ => body.put_slice(&rng.junk(8)),
                    }
                }
                let mut frame = BytesMut::new();
                frame.put_u32_le(12 + body.len() as u32);
                frame.put_u8(1 + rng.below(2) as u8);
                frame.put_u8(opcodes[rng.below(opcodes.len() as u64) as usize]);
                frame.put_u16_le(if rng.below(50) == 0 { 1 } else { 0 });
                frame.put_u64_le(rng.next());
                frame.put_slice(&body);
                let mut v = frame.to_vec();
                // Sometimes cut it short, sometimes append junk.
                match rng.below(6) {
                    0 => v.truncate(rng.below(v.len() as u64 + 1) as usize),
                    1 => v.extend(rng.junk(8)),
                    _ => {}
                }
                v
            }
        };
        let max = if rng.below(10) == 0 {
            rng.below(64) as u32
        } else {
            DEFAULT_MAX_FRAME_BYTES
        };
        let (a, b) = check_decoder_contract(&input, max);
        decoded += matches!(a, Outcome::Decoded { .. }) as u64;
        decoded += matches!(b, Outcome::Decoded { .. }) as u64;
    }
    println!(
        "random_bytes: {decoded} of {} decodes produced a message",
        2 * CASES
    );
}
