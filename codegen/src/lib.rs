//! asteria codegen crate.
