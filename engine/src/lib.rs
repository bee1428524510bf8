//! asteria engine crate.
