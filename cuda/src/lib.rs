//! asteria's CUDA backend: the GPU side of the engine.
//!
//! - [`Device`]: a CUDA context with the `compute`, `copy-in`, `copy-out` and `side` streams,
//!   a cuBLAS handle, and every kernel family compiled by NVRTC for the device's own compute
//!   capability at start-up (cached on disk, see [`nvrtc`]);
//! - [`Arena`] / [`Buf`]: one allocation per tier (device, pinned host), carved at offsets;
//!   peak memory in [`Device::memory_report`];
//! - [`kernels`]: hand-written CUDA C in `cuda/kernels/*.cu`, one family per file;
//! - [`ops`] and [`gemm`]: one host launcher per plan op ([`schedule::Op`]) with the exact
//!   semantics of its docstring and of the CPU kernels in `engine::cpu` / `optim`;
//! - [`selftest`]: runs every launcher on fresh random inputs against those CPU kernels.
//!
//! Nothing here needs CUDA to build: cudarc loads `libcuda`, `libnvrtc` and `libcublas` at run
//! time, and [`Device::new`] returns [`CudaError::NoDriver`] on a machine without a driver.
//! - [`CudaEngine`]: the plan interpreter (an `engine::StepExecutor`), with synchronous
//!   eigenbasis refreshes through cuSOLVER ([`refresh`]) or the host solver;
//! - [`train_match`]: trains one plan on the CPU engine and on the GPU in one process and
//!   compares the losses step by step.
//!
//! Not yet here (later work): pinned-host prefetch of offloaded state, asynchronous refreshes
//! on the side stream with bounded staleness, and NCCL — cudarc 0.19 opens `libnccl.so`
//! only, while GPU hosts often ship just `libnccl.so.2` (seen on the reference H200 host), so the NCCL
//! loader must try the versioned soname itself.
#![deny(missing_docs)]

pub mod calibrate;
mod device;
pub mod energy;
mod engine;
mod error;
pub mod gemm;
pub mod kernels;
mod lt;
mod memory;
pub mod nccl;
pub mod nvrtc;
pub mod ops;
pub mod refresh;
pub mod selftest;
pub mod train_match;
pub mod update_bench;

pub use device::{
    driver_present, peak_bf16_tflops, Device, DeviceInfo, FlashKernels, GemmMath, HostElem,
    MemoryReport, RuntimeKernel, StreamKind,
};
pub use engine::{gpu_trace as engine_trace, CudaEngine, CudaOptions};
pub use error::{CudaError, Result, Tier};
pub use memory::{Arena, Buf, Carver, Elem, BUF_ALIGN};
