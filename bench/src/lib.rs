//! `felix-bench`: reproducible publish / read / queue / end-to-end
//! workloads against Felix (embedded or external) and, for comparison,
//! Redis Streams and NATS JetStream. See docs/benchmarking.md.
//!
//! The binary is `src/main.rs`; everything is in this library so the tests
//! and the criterion benches can reach it.

pub mod broker_metrics;
pub mod cli;
pub mod cpu;
pub mod embedded;
pub mod harness;
pub mod report;
pub mod run;
pub mod sampler;
pub mod targets;
pub mod workloads;
