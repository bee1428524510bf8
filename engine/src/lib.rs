//! The asteria engine: executes a verified [`schedule::Plan`].
//!
//! The engine interprets a plan generically — it has no notion of a GPT. This crate holds the
//! CPU backend ([`cpu`]: kernels generic over [`cpu::Float`] and the interpreter
//! [`cpu::CpuEngine`]), the refresh runtime both engines share ([`refresh_runtime`]: when
//! eigenbasis refreshes run, swaps, the staleness bound, failures), the training loop
//! [`train`] (data through `asteria-data`), and the NVMe tier store ([`nvme`]: a checksummed
//! scratch swap file for optimizer state offloaded to an NVMe drive). It depends only on the
//! plan format, never on the compiler crates.
#![deny(missing_docs)]
// `usize::is_multiple_of` needs Rust 1.87; the workspace supports 1.85.
#![allow(clippy::manual_is_multiple_of)]

pub mod checkpoint;
pub mod cpu;
mod error;
pub mod export;
pub mod fits;
pub mod nvme;
pub mod refresh_runtime;
mod rng;
pub mod sample;
mod train;

pub use cpu::{CpuEngine, EngineOptions, EngineStats};
pub use error::EngineError;
pub use refresh_runtime::HostTaskReport;
pub use rng::{normal_fill, Rng, INIT_CHUNK};
pub use train::{train, train_with, StepExecutor, TrainOptions, TrainSummary};
