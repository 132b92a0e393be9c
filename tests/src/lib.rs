//! Workspace integration tests live in `tests/tests/`.
//!
//! The library itself is empty but for the README's Rust examples, which
//! `cargo test --workspace` compiles and runs as doctests of this crate
//! (it depends on every crate they use), so that the README cannot drift
//! from the API.

#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
