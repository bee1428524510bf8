//! asteria optim crate.
