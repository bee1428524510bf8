//! The device bytes an engine allocates beyond the plan's arenas, as the compiler estimates
//! them: what `tier-placement` and `memory-planning` add to the plan's device arenas before
//! comparing them with the `gpu_memory` budget.
//!
//! A CUDA process holds the context, kernel modules and library workspaces
//! ([`CUDA_CONTEXT_BYTES`]), and the CUDA engine owns four kinds of device memory besides the
//! plan's arenas: the bf16 copies
//! of qkv that saving tensor-core attentions keep for their backward (exact here: the engine
//! sizes its arena with [`saved_attention_qkvs`]), the refresh machinery (cuSOLVER work,
//! the swap buffers, one shadow per asynchronous refresh), the bf16 shadows of SOAP's
//! eigenbases, and op scratch. The refresh and scratch terms follow the engine's allocation
//! formulas with a fixed allowance for cuSOLVER's own workspace and op scratch
//! (a fraction of the plan's device arenas up to [`SCRATCH_ALLOWANCE`]); the engine checks what it really allocated against the budget
//! once everything is allocated and before anything runs, so an estimate that falls short is
//! a clear error at start, never an out-of-memory mid-run. The CPU engine allocates nothing
//! beyond its plan: its reserve is zero.
use crate::{BufferId, DType, HostTask, Op, Placement, Plan, Precision, RefreshMethod, TargetPlan};

/// Alignment of every engine allocation (bytes): the CUDA engine's `BUF_ALIGN`.
const ALIGN: usize = 256;

/// Allowance for op scratch (layer-norm and attention partial sums, the clip reduction) and
/// cuSOLVER's queried workspace, which the compiler does not size: 1/64 of the plan's device
/// arenas, at least 1 MiB and at most this, 128 MiB. Measured: the LLaMA 1.44B plan's engine
/// arena is 0.06 GiB.
pub const SCRATCH_ALLOWANCE: usize = 128 << 20;

fn aligned(bytes: usize) -> usize {
    bytes.div_ceil(ALIGN) * ALIGN
}

/// Device bytes a CUDA process holds outside the engine's arenas: the context, the loaded
/// kernel modules (NVRTC images, cuBLAS/cuBLASLt/cuSOLVER's own) and the libraries' handles and
/// workspaces. Measured on the H200 (CUDA 13): 0.87 GiB beside the LLaMA 1.44B plan's arenas
/// (`GPU peak used` 24.74 GiB against 23.87 GiB of arenas); counted as 1 GiB so that a
/// `gpu_memory` budget bounds what `nvidia-smi` shows for the process.
pub const CUDA_CONTEXT_BYTES: usize = 1 << 30;

/// The engine's device bytes beyond the plan's arenas, by kind (bytes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineReserve {
    /// The CUDA context, kernel modules and library workspaces ([`CUDA_CONTEXT_BYTES`]).
    pub context: usize,
    /// bf16 qkv copies of the saving attentions.
    pub attention_saved: usize,
    /// Refresh work, swap buffers and asynchronous refresh shadows.
    pub refresh: usize,
    /// bf16 shadows of SOAP eigenbases (`precision = bf16`; those a `soap_update` or a
    /// composed step's `project` reads).
    pub basis_shadows: usize,
    /// Op scratch: the scratch of the largest second-order update (SOAP, KL-Shampoo, Shampoo,
    /// a composed SOAP step's `project`; exact), plus an allowance for the other ops and solver workspace (a fraction of the
    /// plan's device arenas up to [`SCRATCH_ALLOWANCE`]).
    pub scratch: usize,
}

impl EngineReserve {
    /// All of it (bytes).
    pub fn total(&self) -> usize {
        self.context + self.attention_saved + self.refresh + self.basis_shadows + self.scratch
    }

    /// `attention-saved 1.12 GiB, refresh 0 B, ...` for reports.
    pub fn describe(&self) -> String {
        let b = |x: usize| {
            let mib = x as f64 / (1u64 << 20) as f64;
            if mib >= 1024.0 {
                format!("{:.2} GiB", mib / 1024.0)
            } else {
                format!("{mib:.2} MiB")
            }
        };
        format!(
            "context {}, attention-saved {}, refresh {}, basis shadows {}, scratch {}",
            b(self.context),
            b(self.attention_saved),
            b(self.refresh),
            b(self.basis_shadows),
            b(self.scratch)
        )
    }
}

/// The qkv buffers (`[N, 3C]`, each once, in program order) whose bf16 copy a saving
/// tensor-core attention (`Attention { lse: Some(..) }`, forward or — under `rematerialize =
/// layers` — backward) keeps for its backward, with their element counts; a bf16 qkv (the
/// `fuse` pass made it so) needs no copy.
pub fn saved_attention_qkvs(plan: &Plan) -> Vec<(BufferId, usize)> {
    let mut out: Vec<(BufferId, usize)> = Vec::new();
    for o in plan.forward.iter().chain(&plan.backward) {
        if let Op::Attention {
            qkv, lse: Some(_), ..
        } = o
        {
            // A bf16 qkv (the `fuse` pass's) is its own bf16 copy.
            if plan.buffer(*qkv).dtype != DType::Bf16 && !out.iter().any(|(q, _)| q == qkv) {
                out.push((*qkv, plan.buffer(*qkv).numel()));
            }
        }
    }
    out
}

/// The attention-saved arena's slots: for each qkv of [`saved_attention_qkvs`] (same order) the
/// slot its bf16 copy goes to, and each slot's elements. A copy is live from the first saving
/// attention that writes it to the last attention backward that reads that qkv (in the order
/// forward, then backward); copies live at disjoint times share a slot (greedy by start, the
/// slot free longest first). Under `rematerialize = layers` each layer's copy is made by its
/// recomputed attention just before its backward: one slot serves every layer. Without it the
/// forward's copies all live until the backward: one slot each.
pub fn saved_attention_slots(plan: &Plan) -> (Vec<usize>, Vec<usize>) {
    let want = saved_attention_qkvs(plan);
    let ops: Vec<&Op> = plan.forward.iter().chain(&plan.backward).collect();
    let span = |qkv: BufferId| {
        let start = ops
            .iter()
            .position(|o| matches!(o, Op::Attention { qkv: q, lse: Some(_), .. } if *q == qkv));
        let end = ops
            .iter()
            .rposition(|o| matches!(o, Op::AttentionBackward { qkv: q, .. } if *q == qkv));
        let start = start.unwrap_or(0);
        (start, end.unwrap_or(start).max(start))
    };
    let mut order: Vec<usize> = (0..want.len()).collect();
    order.sort_by_key(|&i| (span(want[i].0).0, i));
    let mut slot_of = vec![0usize; want.len()];
    // Per slot: elements, and the end of its last copy's span.
    let mut slots: Vec<(usize, usize)> = Vec::new();
    for i in order {
        let (start, end) = span(want[i].0);
        let n = want[i].1;
        let free = slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.1 < start)
            .min_by_key(|(j, s)| (s.1, *j))
            .map(|(j, _)| j);
        let j = match free {
            Some(j) => j,
            None => {
                slots.push((0, 0));
                slots.len() - 1
            }
        };
        slots[j] = (slots[j].0.max(n), end);
        slot_of[i] = j;
    }
    (slot_of, slots.into_iter().map(|s| s.0).collect())
}

/// f32 elements the CUDA engine reserves for each bf16 work matrix of `len` elements (aligned
/// to 256 bytes).
pub fn bf16_slots(len: usize) -> usize {
    len.div_ceil(2).next_multiple_of(64)
}

/// Partial sums of the CUDA engine's sum-of-squares reductions (`SUMSQ_BLOCKS`).
pub const SUMSQ_BLOCKS: usize = 256;

/// Scratch elements (f32) of the CUDA engine's `soap_update` for an `[m, n]` parameter with
/// the given bases: `3·m·n + 2·256 + 2` (projections, f64 partials, the RMS divisor) rounded up
/// to a multiple of 64 (256 bytes), plus with bf16 projections (`bf16`) and a basis the bf16
/// bases (`m²`, `n²`) and two bf16 `[m, n]` matrices, each region rounded up to 256 bytes.
pub fn soap_update_scratch_len(m: usize, n: usize, left: bool, right: bool, bf16: bool) -> usize {
    let base = (3 * m * n + 2 * SUMSQ_BLOCKS + 2).next_multiple_of(64);
    if bf16 && (left || right) {
        base + if left { bf16_slots(m * m) } else { 0 }
            + if right { bf16_slots(n * n) } else { 0 }
            + 2 * bf16_slots(m * n)
    } else {
        base
    }
}

/// Scratch elements (f32) of the CUDA engine's `project` (a composed SOAP step's eigenbasis
/// projection, either direction) of an `[m, n]` operand with the given bases: one f32 `[m, n]`
/// intermediate rounded up to 256 bytes when both bases are there, plus with bf16 projections
/// (`bf16`) and a basis the bf16 bases (`m²`, `n²`) and two bf16 `[m, n]` matrices, each region
/// rounded up to 256 bytes.
pub fn project_scratch_len(m: usize, n: usize, left: bool, right: bool, bf16: bool) -> usize {
    let base = if left && right {
        (m * n).next_multiple_of(64)
    } else {
        0
    };
    if bf16 && (left || right) {
        base + if left { bf16_slots(m * m) } else { 0 }
            + if right { bf16_slots(n * n) } else { 0 }
            + 2 * bf16_slots(m * n)
    } else {
        base
    }
}

/// Scratch elements (f32) of the CUDA engine's `kl_shampoo_update` for an `[m, n]` parameter
/// with the given bases (`left`: `Q_L` present, `right`: `Q_R`), each region rounded up to 64
/// elements (256 bytes): the f64 partials and the RMS divisor (`2·256 + 2`), four vectors
/// (`1/√D` and the new `D` of each side: `m`, `n`, `m`, `n`) and `k` `[m, n]` work matrices,
/// `k = 1 + (left ∨ right) + (left ∧ right)`.
pub fn kl_shampoo_update_scratch_len(m: usize, n: usize, left: bool, right: bool) -> usize {
    let r = |x: usize| x.next_multiple_of(64);
    let k = 1 + usize::from(left || right) + usize::from(left && right);
    r(2 * SUMSQ_BLOCKS + 2) + 2 * r(m) + 2 * r(n) + k * r(m * n)
}

/// CUDA blocks per Shampoo block in the CUDA engine's grafting norm reduction (each writes one
/// f64 partial sum of `‖P‖²` and of `‖Pg‖²`).
pub const SHAMPOO_GRAFT_CHUNKS: usize = 16;

/// Scratch elements (f32) of the CUDA engine's `shampoo_update` for a parameter of `shape`
/// under block size `b` ([`crate::blocking::blocks`]), with a first moment (`moment`: β₁ ≠ 0)
/// and / or Adam grafting (`grafting`), each region rounded up to 64 elements (256 bytes): the
/// bias-corrected moment `Ḡ` (numel, with `moment`); with `grafting` the Adam step `Pg` and the
/// step `P` (numel each), the f64 norm partials (`2·blocks·SHAMPOO_GRAFT_CHUNKS` f64) and the
/// f64 scales (`blocks`); and one work matrix of the largest matrix block (`rows·cols`; none
/// when every block is a vector block).
pub fn shampoo_update_scratch_len(
    shape: &[usize],
    b: usize,
    moment: bool,
    grafting: bool,
) -> usize {
    let r = |x: usize| x.next_multiple_of(64);
    let ((vm, vn), blocks) = crate::blocking::blocks(shape, b);
    let numel = vm * vn;
    let mut len = if moment { r(numel) } else { 0 };
    if grafting {
        len += 2 * r(numel) + r(4 * blocks.len() * SHAMPOO_GRAFT_CHUNKS) + r(2 * blocks.len());
    }
    len + blocks
        .iter()
        .filter(|k| !k.vector)
        .map(|k| r(k.rows * k.cols))
        .max()
        .unwrap_or(0)
}

/// Scratch elements (f32) of the CUDA engine's `ShampooPrecondition` (a composed Shampoo
/// step) on a parameter of `shape` under `max_preconditioner_dim` `b`: the largest matrix
/// block's work matrix.
pub fn shampoo_precondition_scratch_len(shape: &[usize], b: u64) -> usize {
    let b = usize::try_from(b).unwrap_or(usize::MAX).max(1);
    crate::blocking::blocks(shape, b)
        .1
        .iter()
        .filter(|k| !k.vector)
        .map(|k| k.rows * k.cols)
        .max()
        .unwrap_or(0)
}

/// Scratch elements (f32) of the CUDA engine's `Graft`: the per-block f64 norm partials
/// (`2·blocks·SHAMPOO_GRAFT_CHUNKS`) and scales, each region 64-element aligned.
pub fn graft_scratch_len(shape: &[usize], b: u64) -> usize {
    let b = usize::try_from(b).unwrap_or(usize::MAX).max(1);
    let n = crate::blocking::blocks(shape, b).1.len();
    (4 * n * SHAMPOO_GRAFT_CHUNKS).next_multiple_of(64) + 2 * n
}

/// Scratch elements (f32) of the CUDA engine's `KlScale`: `1/√D` of each side (64-element
/// aligned regions).
pub fn kl_scale_scratch_len(m: usize, n: usize) -> usize {
    m.next_multiple_of(64) + n.next_multiple_of(64)
}

/// Scratch elements (f32) of the CUDA engine's `KlFactorUpdate` on `[m, n]` with a left and / or
/// right basis: `1/√D` and the new estimates of each side, one `[m, n]` work matrix and one
/// per basis (64-element aligned regions).
pub fn kl_factor_update_scratch_len(m: usize, n: usize, left: bool, right: bool) -> usize {
    let r = |x: usize| x.next_multiple_of(64);
    let bases = usize::from(left) + usize::from(right);
    2 * (r(m) + r(n)) + (1 + bases) * r(m * n)
}

/// The estimate for `plan` on its target (zero for the CPU engine), given the bytes of its
/// device arenas (`device_bytes`, from memory planning).
pub fn engine_reserve(plan: &Plan, device_bytes: usize) -> EngineReserve {
    let TargetPlan::Cuda { precision, .. } = plan.target else {
        return EngineReserve::default();
    };
    let attention_saved = saved_attention_slots(plan)
        .1
        .iter()
        .map(|n| aligned(n * 2))
        .sum();
    let mut basis_shadows = 0;
    if precision == Precision::Bf16 {
        let mut seen: Vec<BufferId> = Vec::new();
        for o in &plan.optimizer {
            if let Op::SoapUpdate {
                basis_left,
                basis_right,
                ..
            }
            | Op::Project {
                basis_left,
                basis_right,
                ..
            } = o
            {
                for &q in basis_left.iter().chain(basis_right) {
                    if !seen.contains(&q) && plan.buffer(q).dtype == DType::F32 {
                        seen.push(q);
                        basis_shadows += aligned(plan.buffer(q).numel() * 2);
                    }
                }
            }
        }
    }
    // Op scratch is one buffer sized for the largest need; the second-order updates (SOAP's,
    // KL-Shampoo's, Shampoo's) need the most.
    let bf16 = precision == Precision::Bf16;
    let dims = |param: BufferId| {
        let s = &plan.buffer(param).shape;
        match s.as_slice() {
            [m, n] => (*m, *n),
            _ => (1, s.iter().product()),
        }
    };
    let update_scratch = plan
        .optimizer
        .iter()
        .filter_map(|o| match o {
            Op::SoapUpdate {
                param,
                basis_left,
                basis_right,
                ..
            } => {
                let (m, n) = dims(*param);
                let (l, r) = (basis_left.is_some(), basis_right.is_some());
                Some(soap_update_scratch_len(m, n, l, r, bf16) * 4)
            }
            Op::Project {
                x,
                basis_left,
                basis_right,
                ..
            } => {
                let (m, n) = dims(*x);
                let (l, r) = (basis_left.is_some(), basis_right.is_some());
                Some(project_scratch_len(m, n, l, r, bf16) * 4)
            }
            Op::KlShampooUpdate {
                param,
                basis_left,
                basis_right,
                ..
            } => {
                let (m, n) = dims(*param);
                let (l, r) = (basis_left.is_some(), basis_right.is_some());
                Some(kl_shampoo_update_scratch_len(m, n, l, r) * 4)
            }
            Op::KlScale { x, .. } => {
                let (m, n) = dims(*x);
                Some(kl_scale_scratch_len(m, n) * 4)
            }
            Op::KlFactorUpdate {
                grad,
                basis_left,
                basis_right,
                ..
            } => {
                let (m, n) = dims(*grad);
                let (l, r) = (basis_left.is_some(), basis_right.is_some());
                Some(kl_factor_update_scratch_len(m, n, l, r) * 4)
            }
            Op::ShampooPrecondition {
                x,
                max_preconditioner_dim,
                ..
            } => Some(
                shampoo_precondition_scratch_len(&plan.buffer(*x).shape, *max_preconditioner_dim)
                    * 4,
            ),
            Op::Graft {
                x,
                max_preconditioner_dim,
                ..
            } => Some(graft_scratch_len(&plan.buffer(*x).shape, *max_preconditioner_dim) * 4),
            Op::ShampooUpdate { param, hyper, .. } => {
                let b = usize::try_from(hyper.max_preconditioner_dim).unwrap_or(usize::MAX);
                let shape = &plan.buffer(*param).shape;
                let moment = hyper.beta1 != 0.0;
                Some(shampoo_update_scratch_len(shape, b, moment, hyper.grafting) * 4)
            }
            _ => None,
        })
        .max()
        .unwrap_or(0);
    EngineReserve {
        context: CUDA_CONTEXT_BYTES,
        attention_saved,
        refresh: refresh_bytes(plan),
        basis_shadows,
        scratch: aligned(update_scratch) + (device_bytes / 64).clamp(1 << 20, SCRATCH_ALLOWANCE),
    }
}

/// One pool of asynchronous-refresh shadows: the tasks placed on the GPU side stream
/// (`gpu_side`) or on the host, with factors of side `dim`, share `count` shadows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefreshPool {
    /// The tasks run on the GPU side stream (else on the host pool).
    pub gpu_side: bool,
    /// Side of their factors.
    pub dim: usize,
    /// Shadows in the pool: refreshes of the group that can be in flight at once.
    pub count: usize,
}

/// Longest schedule period simulated exactly by [`refresh_pools`]; a longer one (frequencies
/// with a huge least common multiple) gives every task its own shadow.
const MAX_PERIOD: u64 = 100_000;

/// The shadow pools of the plan's asynchronous refreshes (tasks with S > 0): per placement and
/// factor side, the most refreshes that can be in flight at once. A refresh launched at the end
/// of step t (a QR refresh, t > 1: [`crate::refresh_due`]; the first eigendecomposition is
/// synchronous) is installed at the latest at the end of step t + S, before that boundary's
/// launches (the refresh runtime's order), so once a boundary's refreshes are launched those in
/// flight were launched within its last S boundaries: the count is the largest number of a
/// group's tasks due within any S consecutive boundaries, over one period of the schedule. Pools are ordered by (placement, side).
pub fn refresh_pools(plan: &Plan) -> Vec<RefreshPool> {
    struct T {
        gpu: bool,
        d: usize,
        f: u64,
        off: u64,
        s: u64,
    }
    let tasks: Vec<T> = plan
        .host_tasks
        .iter()
        .filter_map(|t| {
            let HostTask::EigenbasisRefresh {
                factor,
                frequency,
                offset,
                staleness,
                placement,
                ..
            } = t;
            (*staleness > 0).then(|| T {
                gpu: *placement == Placement::GpuSide,
                d: plan.buffer(*factor).shape.first().copied().unwrap_or(0),
                f: *frequency,
                off: *offset,
                s: u64::from(*staleness),
            })
        })
        .collect();
    let mut keys: Vec<(bool, usize)> = tasks.iter().map(|t| (t.gpu, t.d)).collect();
    keys.sort_unstable();
    keys.dedup();
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    keys.into_iter()
        .map(|(gpu, d)| {
            let group: Vec<&T> = tasks.iter().filter(|t| t.gpu == gpu && t.d == d).collect();
            let mut period = 1u64;
            for t in &group {
                let f = t.f.max(1);
                period = period / gcd(period, f) * f;
                if period > MAX_PERIOD {
                    break;
                }
            }
            let s = group.iter().map(|t| t.s).max().unwrap_or(0);
            let off = group.iter().map(|t| t.off).max().unwrap_or(0);
            let count = if period > MAX_PERIOD || s > MAX_PERIOD {
                group.len()
            } else {
                let first = 2 + off;
                (first..first + period + s + 1)
                    .map(|end| {
                        let start = (end + 1).saturating_sub(s).max(2);
                        group
                            .iter()
                            .filter(|t| (start..=end).any(|x| crate::refresh_due(x, t.f, t.off)))
                            .count()
                    })
                    .max()
                    .unwrap_or(0)
            };
            RefreshPool {
                gpu_side: gpu,
                dim: d,
                count: count.max(1).min(group.len()),
            }
        })
        .collect()
}

/// Device bytes of one asynchronous-refresh shadow of side `d` (the CUDA engine's `Shadow`):
/// the factor snapshot and the output slot (basis, permutation, status words); none for a
/// GPU-side shadow in pinned host memory (`pinned`: [`crate::MemoryPlan::pinned_refresh_shadows`]).
/// A GPU-side refresh reads the live basis: only its own install writes it, after the refresh.
pub fn shadow_device_bytes(d: usize, gpu_side: bool, pinned: bool) -> usize {
    if gpu_side && pinned {
        return 0;
    }
    let slot = (d * d + d + STATUS_WORDS) * 4 + 3 * ALIGN;
    d * d * 4 + ALIGN + slot
}

/// Pinned host bytes of one such shadow: the status words; for a host refresh the factor and
/// basis snapshots and the permutation; for a GPU-side shadow in pinned memory (`pinned`) the
/// factor snapshot and the output slot.
pub fn shadow_pinned_bytes(d: usize, gpu_side: bool, pinned: bool) -> usize {
    let status = STATUS_WORDS * 4 + ALIGN;
    match (gpu_side, pinned) {
        (true, false) => status,
        (true, true) => status + d * d * 4 + ALIGN + (d * d + d + STATUS_WORDS) * 4 + 3 * ALIGN,
        (false, _) => status + 2 * d * d * 4 + d * 4 + 3 * ALIGN,
    }
}

/// Pinned host bytes of the plan's refresh shadows (every pool), which count against the
/// `host_memory` budget beside the host tier's arena.
pub fn refresh_pinned_bytes(plan: &Plan) -> usize {
    let pinned = plan.memory.pinned_refresh_shadows;
    refresh_pools(plan)
        .iter()
        .map(|p| p.count * shadow_pinned_bytes(p.dim, p.gpu_side, pinned))
        .sum()
}

/// Bounce slots of the CUDA engine's NVMe tier: pinned host buffers every NVMe read and write
/// passes through (a copy in flight each way while the writer thread writes the previous copy
/// out, and a refresh swap's two moments).
pub const NVME_BOUNCE_SLOTS: usize = 4;

/// Pinned host bytes of the CUDA engine's NVMe bounce slots for `plan` as placed:
/// [`NVME_BOUNCE_SLOTS`] slots of its largest NVMe-tier buffer (f32, each rounded up to
/// [`crate::memory::ARENA_ALIGN`]); 0 without NVMe state or on a CPU target (the CPU engine's
/// NVMe store reads into the staging buffers themselves). They share `host_memory` with the
/// host tier and the pinned refresh shadows (`tier-placement` counts them; the engine
/// allocates exactly this).
pub fn nvme_bounce_bytes(plan: &Plan) -> usize {
    if !matches!(plan.target, TargetPlan::Cuda { .. }) {
        return 0;
    }
    let largest = plan
        .buffers
        .iter()
        .zip(&plan.memory.slots)
        .filter(|(_, s)| s.arena == crate::ArenaKind::Nvme)
        .map(|(b, _)| b.numel())
        .max();
    largest.map_or(0, |n| {
        NVME_BOUNCE_SLOTS * (n.max(1) * 4).next_multiple_of(crate::memory::ARENA_ALIGN)
    })
}

/// Device bytes the plan's refresh shadows take on the device (every pool), as placed.
pub fn refresh_shadow_device_bytes(plan: &Plan) -> usize {
    let pinned = plan.memory.pinned_refresh_shadows;
    refresh_pools(plan)
        .iter()
        .map(|p| p.count * shadow_device_bytes(p.dim, p.gpu_side, pinned))
        .sum()
}

/// Bytes the compute stream copies per step, on average, when the GPU-side shadows are pinned:
/// per launch the factor (`d²` f32) to the host and at its install the basis and permutation
/// (`d² + d`) back, each asynchronous GPU-side task once every `frequency` steps (the side
/// stream's own copies of the snapshot in and the result out run off the critical path).
pub fn pinned_shadow_copy_bytes_per_step(plan: &Plan) -> f64 {
    plan.host_tasks
        .iter()
        .map(|t| {
            let HostTask::EigenbasisRefresh {
                factor,
                frequency,
                staleness,
                placement,
                ..
            } = t;
            if *staleness == 0 || *placement != Placement::GpuSide {
                return 0.0;
            }
            let d = plan.buffer(*factor).shape.first().copied().unwrap_or(0);
            ((2 * d * d + d) * 4) as f64 / (*frequency).max(1) as f64
        })
        .sum()
}

/// Status words of a refresh (the CUDA engine's `STATUS_WORDS`).
pub const STATUS_WORDS: usize = 8;

/// The CUDA engine's refresh allocations (`cuda/src/engine/tasks.rs` `Refreshes::new`): per
/// GPU refresher 8 `d×d` f32 work matrices and cuSOLVER's workspace, the output slot, the swap
/// buffers (`d²` and two chunks of [`swap_chunk_len`], sized by the moments of SOAP refreshes
/// only: a [`RefreshMethod::Qr`] refresh installs its basis alone), the
/// shadow pools of the asynchronous refreshes ([`refresh_pools`]; on the device unless
/// [`crate::MemoryPlan::pinned_refresh_shadows`]), and with pinned shadows the side stream's
/// device staging (one factor and one output slot of the largest side).
fn refresh_bytes(plan: &Plan) -> usize {
    let f32s = |n: usize| aligned(n * 4);
    let (mut max_dim, mut max_mn, mut side_dim) = (0usize, 0usize, None::<usize>);
    let (mut any_gpu, mut any_async) = (false, false);
    for t in &plan.host_tasks {
        let HostTask::EigenbasisRefresh {
            factor,
            exp_avg,
            staleness,
            placement,
            method,
            ..
        } = t;
        let d = plan.buffer(*factor).shape.first().copied().unwrap_or(0);
        max_dim = max_dim.max(d);
        if *method == RefreshMethod::Soap {
            max_mn = max_mn.max(plan.buffer(*exp_avg).numel());
        }
        let gpu = *placement == Placement::GpuSide;
        any_gpu |= gpu;
        if *staleness > 0 {
            any_async = true;
            if gpu {
                side_dim = Some(side_dim.map_or(d, |s| s.max(d)));
            }
        }
    }
    // 8 d×d work matrices, tau and the f64 estimates, and cuSOLVER's workspace: LAPACK's
    // syevd needs 1 + 6d + 2d² elements, but cuSOLVER 13's query (the largest of syevd, geqrf,
    // orgqr, potrf) asks for about 4.1 d² on the H200 at d = 2048 and 4096 (the engine's
    // arenas came out 2.0–2.2 d² per refresher above 1 + 6d + 2d²); 1 + 6d + 9d²/2 bounds it,
    // so that the device budget the pass plans against is one the engine's allocation meets.
    let refresher =
        |d: usize| f32s(8 * d * d + 3 * d) + 8 * ALIGN + f32s(1 + 6 * d + 9 * d * d / 2);
    let staging = refresh_staging(plan);
    let square = |d: usize| d.max(1).pow(2) * 4 + ALIGN;
    let mut bytes = refresh_shadow_device_bytes(plan);
    if any_gpu {
        bytes += refresher(max_dim) + f32s(max_dim * max_dim) + f32s(max_dim) + ALIGN;
        bytes +=
            (usize::from(staging.sync_factor) + usize::from(staging.sync_basis)) * square(max_dim);
    }
    if let Some(d) = side_dim {
        bytes += refresher(d);
        if plan.memory.pinned_refresh_shadows {
            bytes += d * d * 4 + ALIGN + (d * d + d + STATUS_WORDS) * 4 + 3 * ALIGN;
        }
        if staging.side_basis {
            bytes += square(d);
        }
    }
    if any_gpu || any_async {
        let chunk = swap_chunk_len(max_dim, max_mn).max(max_dim.max(1));
        bytes += (max_dim.max(1).pow(2) + 2 * chunk) * 4 + 3 * ALIGN;
        if staging.swap_basis {
            bytes += square(max_dim);
        }
    }
    bytes
}

/// Which of the CUDA engine's refresh machinery needs a device copy of a SOAP refresh's
/// Kronecker factor or eigenbasis because `tier-placement` moved it to pinned host memory
/// (its cuSOLVER and cuBLAS calls read device operands): each flag adds one `[d, d]` f32
/// device buffer of that machinery's largest side `d` (the compute-stream refresher's and the
/// swap's: the plan's largest factor; the side stream's: its largest GPU-side asynchronous
/// factor), into which the refresh or swap copies the operand first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RefreshStaging {
    /// A `gpu_side` refresh on the compute stream (every first basis, and S = 0) reads an
    /// offloaded factor.
    pub sync_factor: bool,
    /// ... or an offloaded basis (a QR refresh reads `Q_old`).
    pub sync_basis: bool,
    /// A side-stream refresh (S > 0, `gpu_side`) reads an offloaded basis live (its factor is
    /// a snapshot on the device, or staged from pinned memory already).
    pub side_basis: bool,
    /// A swap re-projects moments with an offloaded basis (`C = Q_oldᵀ Q_new`) before it
    /// overwrites it.
    pub swap_basis: bool,
}

/// The [`RefreshStaging`] of `plan`: what its offloaded Kronecker factors and eigenbases need
/// (all `false` when none left the device).
pub fn refresh_staging(plan: &Plan) -> RefreshStaging {
    let off = |id: BufferId| plan.memory.tier(id).is_some_and(|t| !t.on_device());
    let mut s = RefreshStaging::default();
    for t in &plan.host_tasks {
        let HostTask::EigenbasisRefresh {
            factor,
            basis,
            staleness,
            placement,
            method,
            ..
        } = t;
        let gpu = *placement == Placement::GpuSide;
        s.sync_factor |= gpu && off(*factor);
        s.sync_basis |= gpu && off(*basis);
        s.side_basis |= gpu && *staleness > 0 && off(*basis);
        s.swap_basis |= *method == RefreshMethod::Soap && off(*basis);
    }
    s
}

/// Elements of the refresh swap's chunk buffers at most ([`swap_chunk_len`]): 4 Mi f32, 16 MiB
/// each, one `[2048, 2048]` block.
pub const SWAP_CHUNK: usize = 1 << 22;

/// Elements of each of the CUDA engine's two refresh-swap chunk buffers for the largest factor
/// side `max_dim` and the largest SOAP moment `max_mn` (elements): the swap re-projects and
/// permutes a moment a block of whole rows or columns at a time, so it needs the whole moment
/// only when that is smaller than [`SWAP_CHUNK`], and at least one line (`max_dim`).
pub fn swap_chunk_len(max_dim: usize, max_mn: usize) -> usize {
    max_mn.min(SWAP_CHUNK).max(max_dim).max(1)
}
