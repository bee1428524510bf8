//! asteria's intermediate representation.
#![deny(missing_docs)]

pub mod config;
