//! Benchmarks live in `benches/benches/`; this library holds shared helpers.
