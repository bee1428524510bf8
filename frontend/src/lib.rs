//! asteria frontend crate.
