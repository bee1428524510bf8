//! Typed run options recorded in the plan: every choice that changes what an engine computes or
//! where it computes it is one of these, set by a spec key of the `target` block (or a CLI flag
//! that rewrites the plan before it runs), lowered into [`crate::TargetPlan`] and printed at the
//! start of a run ([`crate::TargetPlan::options_line`]). Engines read them from the plan; no
//! environment variable changes them.
use serde::{Deserialize, Serialize};

/// Defines a closed option enum with its spec/CLI names: `NAMES`, `name()`, `Display` and a
/// `FromStr` whose error lists the allowed values.
macro_rules! named_option {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident = $s:literal),+ $(,)? } default $d:ident) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $name {
            $($(#[$vm])* $v,)+
        }
        impl Default for $name {
            fn default() -> Self {
                $name::$d
            }
        }
        impl $name {
            /// Every value's spelling in specs, plans and CLI flags.
            pub const NAMES: &'static [&'static str] = &[$($s),+];
            /// This value's spelling.
            pub fn name(self) -> &'static str {
                match self {
                    $($name::$v => $s,)+
                }
            }
        }
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
        impl std::str::FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($s => Ok($name::$v),)+
                    _ => Err(format!(
                        "`{s}` is not one of {}",
                        $name::NAMES.join(", ")
                    )),
                }
            }
        }
    };
}

named_option! {
    /// The host eigensolver of first refreshes (`eigh`) and of host-placed QR refreshes
    /// (spec key `eigensolver`, CLI `--eigensolver`). Both give bases of the same factor that
    /// agree to rounding except in nearly degenerate eigenspaces.
    Eigensolver {
        /// `faer` (pure Rust; the default).
        Faer = "faer",
        /// LAPACK `ssyevd` through OpenBLAS (needs the `lapack` feature).
        Lapack = "lapack",
    } default Faer
}

named_option! {
    /// Which kernels run the plan's `Attention` / `AttentionBackward` on the CUDA engine (spec key
    /// `attention` of `target cuda`).
    AttentionKernel {
        /// Under `precision = bf16` the fused tensor-core kernels where the head dim allows
        /// (≤ 128), else the GEMM path; under `precision = fp32` the GEMM path. The default.
        Auto = "auto",
        /// The fused bf16 tensor-core kernels (FlashAttention-2 tiling) whatever the precision;
        /// heads wider than 128 fall back to the GEMM path. Both kinds compute the same math:
        /// Hopper's `wgmma` kernels on compute capability 9.0 (head dims 33..=128), `mma.sync`
        /// elsewhere; the run's first line names the one in use.
        Fused = "fused",
        /// cuBLAS GEMMs around a materialised `T × T` score matrix, in the plan's precision.
        Gemm = "gemm",
    } default Auto
}

named_option! {
    /// Where preconditioner refreshes run (spec key `refresh_placement` of `target cuda`): the
    /// `precond-scheduling` pass writes each refresh's [`crate::Placement`] from it.
    RefreshPlacement {
        /// Per factor, where the target's cost model predicts the least visible time. The
        /// default.
        Auto = "auto",
        /// Every refresh on the GPU side stream (cuSOLVER / cuBLAS).
        Gpu = "gpu",
        /// Every refresh on the host worker pool (through pinned memory on a GPU target).
        Host = "host",
    } default Auto
}

named_option! {
    /// Activation recomputation (spec key `rematerialize` of the `train` block): which forward
    /// activations the `rematerialize` pass recomputes in the backward program instead of
    /// keeping them from the forward. Recomputation runs the same ops on the same inputs, so
    /// the gradients are bit-identical; it trades step time for activation memory.
    Rematerialize {
        /// Keep every activation the backward reads (the default).
        Off = "off",
        /// Recompute the outputs of normalisations (LayerNorm, RMSNorm) and activation
        /// functions (GELU, SwiGLU) from inputs the backward keeps anyway: no GEMM is rerun
        /// (Korthikanti et al. 2022's "selective" recomputation applied to the cheap ops).
        Selective = "selective",
        /// Keep only each transformer layer's input (the residual stream between layers) and
        /// rerun the layer's forward, GEMMs and attention included, just before its backward
        /// (Chen et al. 2016's per-layer checkpointing; about one extra forward per step).
        Layers = "layers",
    } default Off
}

named_option! {
    /// When an asynchronous preconditioner refresh (staleness S > 0) is installed (spec key
    /// `refresh_swap` of the `train` block). Both keep every basis at most S steps old; they
    /// differ in which step a finished refresh's basis is first used.
    RefreshSwap {
        /// At the first step boundary after the refresh finished (waiting only at the bound
        /// S): the freshest bases, but which step gets a new basis depends on how fast the
        /// refresh ran, so two runs of the same plan can differ. The default.
        Finished = "finished",
        /// Exactly S steps after its launch, finished earlier or not: every run of the plan
        /// uses the same bases at the same steps (reproducible on one engine, and a resumed
        /// run replays the uninterrupted one); the bases are always S steps old.
        Deadline = "deadline",
    } default Finished
}

named_option! {
    /// How often a weight is rounded to bf16 for the GEMMs under `precision = bf16` (spec key
    /// `weight_casts` of `target cuda`): the `fuse` pass's `bf16-cast` rule places the casts. The
    /// copies hold the same bits either way; the choice trades memory traffic for memory.
    WeightCasts {
        /// `once` unless the run trades time for memory already: a `gpu_memory` budget, or
        /// `rematerialize` other than `off` (then `twice`). The default.
        Auto = "auto",
        /// Cast each weight once per step, in the forward, and keep the bf16 copy alive until
        /// its last GEMM in the backward (as PyTorch's autocast keeps its casts): 2 bytes per
        /// weight element more at the activation peak, one pass over the fp32 weights fewer.
        Once = "once",
        /// Cast each weight in the forward and again in the backward: each copy lives only
        /// around its GEMMs.
        Twice = "twice",
    } default Auto
}

named_option! {
    /// Where AdamW's element-wise updates run (spec key `host_updates` of the `target` block;
    /// ZeRO-Offload's CPU optimizer, Ren et al. 2021). Under `sync` or `delayed` the
    /// `tier-placement` pass moves every `adam_w` update whose gradient can stream out to the
    /// host: its parameter's master copy, moments and gradient live in pinned host memory, the
    /// update runs on the host cores (`Op::AdamW::on_host`, the generated host kernel), and
    /// the forward and backward read a device copy `<param>.device` that a `copy_in` refreshes
    /// once per step.
    HostUpdates {
        /// Every update on the device (the default).
        Off = "off",
        /// The device copy is refreshed after the host update of the same step: the same
        /// numbers as `off`, the device waits for the host update.
        Sync = "sync",
        /// The device copy is refreshed before the host update (with the result of the
        /// previous step's), so the host update overlaps the next step's forward and backward:
        /// each step's gradient is taken at parameters one update old (ZeRO-Offload's delayed
        /// parameter update). Changes the numbers.
        Delayed = "delayed",
    } default Off
}

named_option! {
    /// A measurement switch of the CUDA engine (CLI `--profile`): per-op GPU times, printed at
    /// the end of the run. It changes the run's timing, never what it computes.
    Profile {
        /// No profile (the default).
        Off = "off",
        /// A host synchronisation around every op (per-op host and GPU time, slow steps).
        Ops = "ops",
        /// CUDA events around every op (GPU time only; steps keep their overlap).
        Events = "events",
    } default Off
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_values_list_the_allowed_ones() {
        for n in AttentionKernel::NAMES {
            assert_eq!(n.parse::<AttentionKernel>().map(|a| a.name()), Ok(*n));
        }
        for n in RefreshPlacement::NAMES {
            assert_eq!(n.parse::<RefreshPlacement>().map(|a| a.name()), Ok(*n));
        }
        for n in Eigensolver::NAMES {
            assert_eq!(n.parse::<Eigensolver>().map(|a| a.name()), Ok(*n));
        }
        let e = "flash".parse::<AttentionKernel>().unwrap_err();
        assert!(e.contains("auto, fused, gemm"), "{e}");
        assert_eq!(
            serde_json::to_string(&RefreshPlacement::Gpu).expect("serialises"),
            "\"gpu\""
        );
    }
}
