//! Test support
