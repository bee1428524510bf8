//! asteria passes crate.
