//! asteria data crate.
