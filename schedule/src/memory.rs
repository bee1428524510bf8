//! The memory plan ([`MemoryPlan`]): the arena and byte offset of every plan buffer, and the
//! liveness facts ([`Plan::residency`]) that decide which buffers may share bytes.
//!
//! # Arenas
//! An engine allocates one arena per entry of [`MemoryPlan::arenas`] (on the CUDA engine one
//! device allocation each, of exactly [`ArenaPlan::bytes`]) and places buffer `i` at
//! `slots[i].offset` bytes from the start of arena `slots[i].arena`. Offsets are multiples of
//! [`ARENA_ALIGN`] (256 bytes, the CUDA arena's alignment).
//! - [`ArenaKind::Persistent`]: buffers whose contents matter outside one op range of one step
//!   (parameters, optimizer state, data inputs, the loss, anything a host task or the host
//!   touches, anything read before it is written). One place per buffer: no two buffers of this
//!   arena overlap.
//! - [`ArenaKind::Activations`]: step-local buffers ([`Residency::Transient`]): activations and
//!   gradients, which live from the backward op that first writes them to the optimizer op that
//!   last reads them, so a layer's gradients take the bytes its activations free during the
//!   backward pass (as PyTorch's `zero_grad(set_to_none=True)` does, planned). Two of them may
//!   overlap in bytes only when their live ranges are disjoint. The contents of such a buffer
//!   are defined only inside its live range: read outside it (e.g. downloaded by the host after
//!   the step) it holds whatever a later buffer wrote there.
//! - [`ArenaKind::Host`] and [`ArenaKind::Nvme`]: the tiers below the device. The
//!   `tier-placement` pass moves optimizer state there when the device budget
//!   ([`Budgets::device`]) cannot hold everything: pinned host memory on a GPU (a separate host
//!   store on the CPU engine) and a checksummed file in the spec's `nvme` directory. An engine
//!   never computes on these bytes: `prefetch-insertion`'s [`Op::CopyIn`] brings a buffer into
//!   its staging buffer (a transient buffer of the activations arena) before use and
//!   [`Op::CopyOut`] writes it back after its last writer. A buffer's *tier* is its arena's:
//!   `persistent` and `activations` are the device.
//!
//! # Step positions and live ranges
//! The ops of one training step are numbered in execution order — forward `0..F`, backward
//! `F..F+B`, optimizer `F+B..F+B+O` — and such a number is a *step position*
//! ([`Plan::step_position`] names it, e.g. `backward[3]`). A transient buffer's [`LiveRange`]
//! runs from the first op that touches it (which only writes it) to the last op that reads or
//! writes it, both inclusive.
//!
//! # Which buffers are step-local
//! A buffer is transient ([`Plan::residency`]) only when all of these hold; otherwise it is
//! persistent and gets a [`PersistReason`]:
//! 1. its class is [`BufferClass::Activation`] or [`BufferClass::Gradient`] (parameters,
//!    optimizer state, inputs and scalars persist), or it is the staging buffer of offloaded
//!    state (the destination of an [`Op::CopyIn`]);
//! 2. the plan does not name it as `loss`, a data input, a parameter, or an operand of a host
//!    task (those are read or written by the host between programs);
//! 3. some op touches it, and the first op that does (in step order) only writes it — no read
//!    and no read-modify-write such as `MatMul { accumulate: true }` or the in-place optimizer
//!    updates.
//!
//! Then every program run that reads the buffer has written it first, and nothing outside the
//! programs looks at it: the training step runs forward, backward and optimizer from their
//! starts; the evaluation runs the forward program alone, a prefix of the step, during which the
//! (truncated) live ranges are still disjoint; a step cut short by a non-finite gradient norm
//! only skips ops. Reusing bytes is therefore invisible to the results — which the CPU engine's
//! poisoning mode (`engine::EngineOptions::poison_transients`) checks in CI.
use crate::{Buffer, BufferClass, BufferId, Op, Plan, PlanError};
use serde::{Deserialize, Serialize};

/// Alignment of every arena offset, in bytes. Equal to the CUDA arena's `BUF_ALIGN` (cuBLAS
/// operands and vector loads want 256-byte alignment); the CUDA crate checks the two agree.
pub const ARENA_ALIGN: usize = 256;

/// Bytes of a tensor of `shape` with elements of `elem` bytes; `None` on overflow (the
/// compiler's memory ceiling and the engines' fit checks count with it).
pub fn checked_bytes(shape: &[usize], elem: usize) -> Option<u64> {
    shape
        .iter()
        .try_fold(elem as u64, |a, &d| a.checked_mul(d as u64))
}

/// `bytes` rounded up to a multiple of `align` (a power of two); saturates at the largest
/// multiple below `usize::MAX` instead of overflowing.
pub fn align_up(bytes: usize, align: usize) -> usize {
    debug_assert!(align.is_power_of_two(), "invariant: power-of-two alignment");
    bytes
        .checked_add(align - 1)
        .map_or(usize::MAX & !(align - 1), |b| b & !(align - 1))
}

/// What an arena holds (one arena of each kind at most).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArenaKind {
    /// Buffers that live for the whole run; never shared.
    Persistent,
    /// Step-local buffers; bytes reused across disjoint live ranges.
    Activations,
    /// Offloaded persistent buffers in host memory (pinned on a GPU target); never shared.
    Host,
    /// Offloaded persistent buffers in the NVMe store (a file in [`Budgets::nvme_dir`]);
    /// never shared.
    Nvme,
}

impl ArenaKind {
    /// Every kind, in arena order.
    pub const ALL: [ArenaKind; 4] = [
        ArenaKind::Persistent,
        ArenaKind::Activations,
        ArenaKind::Host,
        ArenaKind::Nvme,
    ];

    /// The snake_case name (as in the plan JSON and the engines' reports).
    pub fn name(self) -> &'static str {
        match self {
            ArenaKind::Persistent => "persistent",
            ArenaKind::Activations => "activations",
            ArenaKind::Host => "host",
            ArenaKind::Nvme => "nvme",
        }
    }

    /// Whether buffers of this arena live on the engine's device (where ops run), as opposed
    /// to an offload tier that only [`Op::CopyIn`] / [`Op::CopyOut`] touch.
    pub fn on_device(self) -> bool {
        matches!(self, ArenaKind::Persistent | ArenaKind::Activations)
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for ArenaKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One arena of the memory plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArenaPlan {
    /// What it holds.
    pub kind: ArenaKind,
    /// Size to allocate, in bytes (a multiple of [`ARENA_ALIGN`]; may be 0).
    pub bytes: usize,
}

/// Where one buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferSlot {
    /// The arena.
    pub arena: ArenaKind,
    /// Byte offset from the arena's start (a multiple of [`ARENA_ALIGN`]).
    pub offset: usize,
}

/// The memory budgets of a run (spec keys of the `target` block), in bytes; `None` = no limit.
/// The compiler's `tier-placement` pass fits the plan under them and [`Plan::verify`] refuses a
/// memory plan whose arenas exceed them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budgets {
    /// The engine's device memory (`gpu_memory` on `target cuda`, `memory` on `target cpu`):
    /// the `persistent` and `activations` arenas together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<u64>,
    /// The host tier (`host_memory`): the `host` arena.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<u64>,
    /// The directory of the NVMe tier's file (`nvme`); no NVMe tier without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvme_dir: Option<String>,
    /// The NVMe tier (`nvme_memory`): the `nvme` arena.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvme: Option<u64>,
    /// Where AdamW's updates run (`host_updates`): with `sync` or `delayed` `tier-placement`
    /// moves them and their state to the host whatever the budgets.
    #[serde(default, skip_serializing_if = "is_off")]
    pub host_updates: crate::HostUpdates,
}

fn is_off(h: &crate::HostUpdates) -> bool {
    *h == crate::HostUpdates::Off
}

impl Budgets {
    /// True when no key is set (nothing to place: every buffer stays on the device).
    pub fn is_empty(&self) -> bool {
        *self == Budgets::default()
    }

    /// The budgets as the spec keys that set them, e.g. `gpu_memory 24.00 GiB, host_memory
    /// 96.00 GiB, nvme /mnt/nvme (no limit)`; `device_key` is the target's name of the device
    /// budget (`gpu_memory` or `memory`). Empty when none is set.
    pub fn describe(&self, device_key: &str) -> String {
        let size = |b: u64| crate::limits::human_size(u128::from(b));
        let mut parts = Vec::new();
        if let Some(d) = self.device {
            parts.push(format!("{device_key} {}", size(d)));
        }
        if let Some(h) = self.host {
            parts.push(format!("host_memory {}", size(h)));
        }
        if let Some(dir) = &self.nvme_dir {
            parts.push(format!(
                "nvme {dir} ({})",
                self.nvme.map_or("no limit".to_string(), size)
            ));
        }
        if self.host_updates != crate::HostUpdates::Off {
            parts.push(format!("host_updates {}", self.host_updates));
        }
        parts.join(", ")
    }
}

/// The memory plan of a [`Plan`]: its arenas and the slot of every buffer. Written by the
/// compiler (`lower` writes [`MemoryPlan::unshared`], `memory-planning` the shared layout) and
/// checked by [`Plan::verify`] (slots in range and aligned, persistent buffers never shared,
/// shared bytes only between disjoint live ranges).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryPlan {
    /// Alignment of every offset in bytes; always [`ARENA_ALIGN`].
    pub alignment: usize,
    /// The arenas to allocate, each kind at most once.
    pub arenas: Vec<ArenaPlan>,
    /// One slot per buffer, indexed like [`Plan::buffers`].
    pub slots: Vec<BufferSlot>,
    /// The budgets the arenas must fit ([`Plan::verify`] checks them).
    #[serde(default, skip_serializing_if = "Budgets::is_empty")]
    pub budgets: Budgets,
    /// Whether the shadows of asynchronous GPU-side refreshes (the factor snapshot taken at a
    /// launch, and the result basis and permutation waiting for their install) live in pinned
    /// host memory instead of device memory: `tier-placement` sets it when a device budget
    /// is exceeded, before it offloads any moment (see `schedule::reserve::refresh_bytes`).
    /// The CUDA engine then copies a factor to the host at each launch and a result back at
    /// each install (per launch `2·d²` f32 each way); the values computed are the same. The CPU
    /// engine keeps everything in host memory either way.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pinned_refresh_shadows: bool,
    /// `Some(k)`: the optimizer program's copies out may still run while the next step's
    /// forward runs its ops `0..=k` (step positions). `copy-out-overlap` sets it after placing
    /// the staging buffers those copies read ([`Plan::optimizer_copy_out_sources`]) apart from
    /// every buffer live in `forward[0..=k]`; [`Plan::verify`] checks that. The CUDA engine
    /// then ends a step without waiting for its copy-out stream, and an op of the next step
    /// that touches bytes a pending copy out reads or writes waits for it by event. `None`:
    /// every copy ends with its step. The values computed are the same either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub carried_copy_outs: Option<usize>,
}

impl MemoryPlan {
    /// One place per buffer: every buffer in the persistent arena, in order, at increasing
    /// [`ARENA_ALIGN`]-aligned offsets (no sharing; what an engine without a memory planner
    /// would allocate). Always valid.
    pub fn unshared(buffers: &[Buffer]) -> MemoryPlan {
        let mut offset = 0usize;
        let slots = buffers
            .iter()
            .map(|b| {
                let slot = BufferSlot {
                    arena: ArenaKind::Persistent,
                    offset,
                };
                offset = offset.saturating_add(align_up(b.size_bytes(), ARENA_ALIGN));
                slot
            })
            .collect();
        MemoryPlan {
            alignment: ARENA_ALIGN,
            arenas: vec![ArenaPlan {
                kind: ArenaKind::Persistent,
                bytes: offset,
            }],
            slots,
            budgets: Budgets::default(),
            pinned_refresh_shadows: false,
            carried_copy_outs: None,
        }
    }

    /// Bytes of the arena of `kind` (0 when the plan has none).
    pub fn arena_bytes(&self, kind: ArenaKind) -> usize {
        self.arenas
            .iter()
            .filter(|a| a.kind == kind)
            .map(|a| a.bytes)
            .sum()
    }

    /// Bytes of the arenas on the engine's device (`persistent` and `activations`).
    pub fn device_bytes(&self) -> usize {
        self.arenas
            .iter()
            .filter(|a| a.kind.on_device())
            .map(|a| a.bytes)
            .sum()
    }

    /// The arena (tier) of buffer `id`, `None` when out of range.
    pub fn tier(&self, id: BufferId) -> Option<ArenaKind> {
        self.slots.get(id.index()).map(|s| s.arena)
    }

    /// Bytes of all arenas together.
    pub fn total_bytes(&self) -> usize {
        self.arenas.iter().map(|a| a.bytes).sum()
    }

    /// The slot of buffer `id` (`None` when out of range).
    pub fn slot(&self, id: BufferId) -> Option<BufferSlot> {
        self.slots.get(id.index()).copied()
    }

    /// True when buffer `id` lives in the shared [`ArenaKind::Activations`] arena, i.e. its
    /// contents are defined only inside its live range.
    pub fn is_shared(&self, id: BufferId) -> bool {
        self.slot(id)
            .is_some_and(|s| s.arena == ArenaKind::Activations)
    }
}

/// How an op uses one operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// Only read.
    Read,
    /// Completely overwritten, without reading the previous contents.
    Write,
    /// Read and written (in-place update or accumulation).
    ReadWrite,
}

impl Access {
    /// True for `Read` and `ReadWrite`.
    pub fn reads(self) -> bool {
        matches!(self, Access::Read | Access::ReadWrite)
    }
    /// True for `Write` and `ReadWrite`.
    pub fn writes(self) -> bool {
        matches!(self, Access::Write | Access::ReadWrite)
    }
}

impl Op {
    /// Every buffer operand with its field name and how the op uses it (optional operands
    /// only when present). Outputs that the op overwrites completely are [`Access::Write`];
    /// `MatMul { accumulate: true }`'s `out`, the gradients scaled in place by
    /// `ClipGradNorm` (without a `scale` output) and the in-place state of the optimizer updates are
    /// [`Access::ReadWrite`]. This is the semantics every engine implements and that the
    /// memory planner relies on.
    pub fn accesses(&self) -> Vec<(&'static str, BufferId, Access)> {
        self.operands()
            .into_iter()
            .map(|(name, id)| (name, id, self.access_of(name)))
            .collect()
    }

    fn access_of(&self, operand: &str) -> Access {
        match (self, operand) {
            (
                Op::MatMul {
                    accumulate,
                    micro_accumulate,
                    ..
                },
                "out",
            ) => {
                if *accumulate || micro_accumulate.is_some() {
                    Access::ReadWrite
                } else {
                    Access::Write
                }
            }
            (Op::ClipGradNorm { scale: None, .. }, "grads") => Access::ReadWrite,
            (Op::ClipGradNorm { .. }, "scale") => Access::Write,
            // Each writes its own slot and keeps the others: the buffer persists (a few
            // hundred KiB).
            (Op::GradSumSquares { .. }, "partials") => Access::ReadWrite,
            (Op::ScaleByScalar { .. }, "x") => Access::ReadWrite,
            // Read-modify-write on every micro-batch but the first: the total persists.
            (Op::GradAccumulate { .. }, "total") => Access::ReadWrite,
            (Op::Attention { .. }, "lse") => Access::Write,
            (Op::AdamW { .. } | Op::SoapUpdate { .. }, "param" | "exp_avg" | "exp_avg_sq") => {
                Access::ReadWrite
            }
            (Op::SoapFactorUpdate { .. }, "factor_left" | "factor_right") => Access::ReadWrite,
            (Op::ShampooFactorUpdate { .. }, "factor") => Access::ReadWrite,
            (
                Op::KlFactorUpdate { .. },
                "factor_left" | "factor_right" | "eig_left" | "eig_right",
            ) => Access::ReadWrite,
            (
                Op::KlShampooUpdate { .. },
                "param" | "exp_avg" | "factor_left" | "factor_right" | "eig_left" | "eig_right",
            ) => Access::ReadWrite,
            (Op::ShampooUpdate { .. }, "param" | "exp_avg" | "graft_sq" | "factor") => {
                Access::ReadWrite
            }
            (Op::ElementwiseUpdate { .. }, "param" | "state") => Access::ReadWrite,
            (Op::ElementwiseUpdate { .. }, "result") => Access::Write,
            (Op::CopyIn { .. } | Op::CopyOut { .. } | Op::BlockCopy { .. }, "dst") => Access::Write,
            (Op::BlockWrite { .. }, "dst") => Access::ReadWrite,
            (
                _,
                "out" | "out_bf16" | "dtable" | "dpos" | "dx" | "dweight" | "dbias" | "dqkv"
                | "loss" | "dlogits" | "norm",
            ) => Access::Write,
            _ => Access::Read,
        }
    }
}

/// Step positions `first..=last` (see the module docs) during which a transient buffer holds
/// a value some op still needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LiveRange {
    /// Step position of the op that first writes the buffer.
    pub first: usize,
    /// Step position of the last op that reads or writes it (inclusive).
    pub last: usize,
}

impl LiveRange {
    /// True when the two ranges share a step position.
    pub fn overlaps(&self, other: &LiveRange) -> bool {
        self.first <= other.last && other.first <= self.last
    }
    /// True when step position `pos` is inside the range.
    pub fn contains(&self, pos: usize) -> bool {
        self.first <= pos && pos <= self.last
    }
}

/// Why a buffer must persist (in precedence order: the first that applies is reported).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PersistReason {
    /// `plan.loss` (read by the host after the forward program).
    Loss,
    /// `data.tokens` / `data.targets` (written by the host before the forward program).
    DataInput,
    /// A trainable parameter.
    Parameter,
    /// An operand of a host task (refreshes read and write it between steps).
    HostTask,
    /// A class that lives across steps or is read by the host (anything but activations).
    Class(BufferClass),
    /// No op touches it (kept in its own place, conservatively).
    Unused,
    /// The first op that touches it (this step position) reads it: it carries a value from a
    /// previous step or from its initialisation.
    ReadBeforeWrite {
        /// Step position of that op.
        at: usize,
    },
}

impl PersistReason {
    /// A short human-readable phrase (`parameter`, `read before written at backward[3]`).
    pub fn describe(&self, plan: &Plan) -> String {
        match self {
            PersistReason::Loss => "the loss".into(),
            PersistReason::DataInput => "a data input".into(),
            PersistReason::Parameter => "a parameter".into(),
            PersistReason::HostTask => "a host-task operand".into(),
            PersistReason::Class(c) => {
                let name = serde_json::to_value(c)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_else(|| format!("{c:?}"));
                format!("class {name}")
            }
            PersistReason::Unused => "unused by every op".into(),
            PersistReason::ReadBeforeWrite { at } => {
                format!("read before written, at {}", plan.step_position(*at))
            }
        }
    }
}

/// Whether a buffer may share bytes, and when it is live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Residency {
    /// Step-local: defined only inside the live range.
    Transient(LiveRange),
    /// Must keep its own bytes for the whole run.
    Persistent(PersistReason),
}

impl Residency {
    /// The live range of a transient buffer.
    pub fn live_range(&self) -> Option<LiveRange> {
        match self {
            Residency::Transient(r) => Some(*r),
            Residency::Persistent(_) => None,
        }
    }
}

impl Plan {
    /// Number of ops in one training step (forward + backward + optimizer).
    pub fn step_len(&self) -> usize {
        self.forward.len() + self.backward.len() + self.optimizer.len()
    }

    /// The ops of one training step with their step positions, in execution order.
    pub fn step_ops(&self) -> impl Iterator<Item = (usize, &Op)> + '_ {
        self.forward
            .iter()
            .chain(&self.backward)
            .chain(&self.optimizer)
            .enumerate()
    }

    /// Step position of op `index` of program `section` (`"forward"`, `"backward"` or
    /// `"optimizer"`; anything else is treated as the optimizer).
    pub fn step_position_of(&self, section: &str, index: usize) -> usize {
        match section {
            "forward" => index,
            "backward" => self.forward.len() + index,
            _ => self.forward.len() + self.backward.len() + index,
        }
    }

    /// The name of step position `pos`: `forward[i]`, `backward[i]`, `optimizer[i]` (or
    /// `end[i]` past the step).
    pub fn step_position(&self, pos: usize) -> String {
        let (f, b, o) = (
            self.forward.len(),
            self.backward.len(),
            self.optimizer.len(),
        );
        if pos < f {
            format!("forward[{pos}]")
        } else if pos < f + b {
            format!("backward[{}]", pos - f)
        } else if pos < f + b + o {
            format!("optimizer[{}]", pos - f - b)
        } else {
            format!("end[{}]", pos - f - b - o)
        }
    }

    /// The residency of every buffer (indexed like [`Plan::buffers`]): transient with its live
    /// range, or persistent with the reason (rules in the module docs). Operands out of range
    /// are ignored (call [`Plan::verify`] first for a meaningful answer).
    pub fn residency(&self) -> Vec<Residency> {
        let n = self.buffers.len();
        // Per buffer: (step position of the first op touching it, whether that op only
        // writes it), and the step position of the last op touching it.
        let mut first: Vec<Option<(usize, bool)>> = vec![None; n];
        let mut last = vec![0usize; n];
        for (pos, op) in self.step_ops() {
            let acc = op.accesses();
            for &(_, id, _) in &acc {
                let i = id.index();
                if i >= n {
                    continue;
                }
                if first[i].is_none() {
                    let reads = acc.iter().any(|&(_, j, a)| j == id && a.reads());
                    first[i] = Some((pos, !reads));
                }
                last[i] = pos;
            }
        }
        // Staging buffers of offloaded state (`CopyIn` destinations) are step-local whatever
        // their class.
        // A device copy (`Init::CopyOf` its source: a host update's `<param>.device`) carries
        // its values across steps: persistent.
        let mut staged = vec![false; n];
        for (_, op) in self.step_ops() {
            if let Op::CopyIn { src, dst, .. } = op {
                let copy = self
                    .buffers
                    .get(dst.index())
                    .is_some_and(|b| b.init == crate::Init::CopyOf { of: *src });
                if let Some(s) = staged.get_mut(dst.index()) {
                    *s = !copy;
                }
            }
        }
        let mut role: Vec<Option<PersistReason>> = vec![None; n];
        let mut mark = |id: BufferId, why: PersistReason| {
            if let Some(r) = role.get_mut(id.index()) {
                r.get_or_insert(why);
            }
        };
        mark(self.loss, PersistReason::Loss);
        mark(self.data.tokens, PersistReason::DataInput);
        mark(self.data.targets, PersistReason::DataInput);
        for p in &self.params {
            mark(p.param, PersistReason::Parameter);
        }
        for t in &self.host_tasks {
            for (_, id) in t.operands() {
                mark(id, PersistReason::HostTask);
            }
        }
        (0..n)
            .map(|i| {
                if let Some(why) = role[i] {
                    return Residency::Persistent(why);
                }
                let class = self.buffers[i].class;
                if !matches!(class, BufferClass::Activation | BufferClass::Gradient) && !staged[i] {
                    return Residency::Persistent(PersistReason::Class(class));
                }
                match first[i] {
                    None => Residency::Persistent(PersistReason::Unused),
                    Some((at, false)) => {
                        Residency::Persistent(PersistReason::ReadBeforeWrite { at })
                    }
                    Some((at, true)) => Residency::Transient(LiveRange {
                        first: at,
                        last: last[i],
                    }),
                }
            })
            .collect()
    }

    /// The largest number of bytes of transient buffers live at one step position — a lower
    /// bound on the size of any valid activations arena (`residency` from
    /// [`Plan::residency`]). Buffers whose slot `tier-placement` put in the host or NVMe arena
    /// (streamed gradients' homes) are not on the device and not counted.
    pub fn peak_live_bytes(&self, residency: &[Residency]) -> usize {
        let off_device = |i: usize| {
            self.memory
                .slots
                .get(i)
                .is_some_and(|s| matches!(s.arena, ArenaKind::Host | ArenaKind::Nvme))
        };
        let mut delta = vec![0i128; self.step_len() + 1];
        for (i, (b, r)) in self.buffers.iter().zip(residency).enumerate() {
            if off_device(i) {
                continue;
            }
            if let Residency::Transient(live) = r {
                if live.last < self.step_len() {
                    delta[live.first] += b.size_bytes() as i128;
                    delta[live.last + 1] -= b.size_bytes() as i128;
                }
            }
        }
        let (mut live, mut peak) = (0i128, 0i128);
        for d in delta {
            live += d;
            peak = peak.max(live);
        }
        peak as usize
    }
}

pub(crate) fn invalid(message: String) -> PlanError {
    PlanError::Memory(message)
}

/// Checks [`Plan::memory`] (called by [`Plan::verify`] after the operand checks): alignment,
/// one slot per buffer, every arena listed once and no larger than all buffers unshared,
/// every slot aligned and inside its arena, only transient buffers in the shared arena,
/// no overlap in the persistent arena, and overlapping transient buffers with disjoint live
/// ranges.
pub(crate) fn verify_memory(plan: &Plan) -> Result<(), PlanError> {
    let m = &plan.memory;
    if m.alignment != ARENA_ALIGN {
        return Err(invalid(format!(
            "alignment is {} bytes, but engines place buffers at multiples of {ARENA_ALIGN} bytes",
            m.alignment
        )));
    }
    if m.slots.len() != plan.buffers.len() {
        return Err(invalid(format!(
            "{} slots for {} buffers (one slot per buffer)",
            m.slots.len(),
            plan.buffers.len()
        )));
    }
    let mut capacity: [Option<usize>; 4] = [None; 4];
    for a in &m.arenas {
        if capacity[a.kind.index()].replace(a.bytes).is_some() {
            return Err(invalid(format!("arena `{}` is listed twice", a.kind)));
        }
        if a.bytes % ARENA_ALIGN != 0 {
            return Err(invalid(format!(
                "arena `{}` has {} bytes, not a multiple of {ARENA_ALIGN}",
                a.kind, a.bytes
            )));
        }
    }
    let name = |i: usize| &plan.buffers[i].name;
    let mut members: [Vec<(usize, usize, usize)>; 4] = Default::default();
    for (i, (b, s)) in plan.buffers.iter().zip(&m.slots).enumerate() {
        let Some(cap) = capacity[s.arena.index()] else {
            return Err(invalid(format!(
                "buffer #{i} `{}` is placed in arena `{}`, which the memory plan does not list",
                name(i),
                s.arena
            )));
        };
        if s.offset % ARENA_ALIGN != 0 {
            return Err(invalid(format!(
                "buffer #{i} `{}` is at offset {} of arena `{}`, not a multiple of the {ARENA_ALIGN}-byte alignment",
                name(i),
                s.offset,
                s.arena
            )));
        }
        let size = b.size_bytes();
        match s.offset.checked_add(size) {
            Some(end) if end <= cap => members[s.arena.index()].push((s.offset, end, i)),
            _ => {
                return Err(invalid(format!(
                    "buffer #{i} `{}` ({size} bytes at offset {}) does not fit in arena `{}` of {cap} bytes",
                    name(i),
                    s.offset,
                    s.arena
                )))
            }
        }
    }
    // A sanity bound against absurd allocations from a tampered plan.
    let unshared = plan.buffers.iter().fold(0usize, |acc, b| {
        acc.saturating_add(align_up(b.size_bytes(), ARENA_ALIGN))
    });
    for a in &m.arenas {
        if a.bytes > unshared {
            return Err(invalid(format!(
                "arena `{}` has {} bytes, more than the {unshared} bytes all the plan's buffers need without any sharing",
                a.kind, a.bytes
            )));
        }
    }
    crate::tiers::verify_tiers(plan)?;
    let residency = plan.residency();
    // Copies out carried into the next step's forward: their sources stay apart from
    // everything live in `forward[0..=k]`.
    let carried = crate::tiers::carried_head(plan)?;
    let carried_src = plan.optimizer_copy_out_sources(&residency);
    for &(_, _, i) in &members[ArenaKind::Activations.index()] {
        if let Residency::Persistent(why) = residency[i] {
            return Err(invalid(format!(
                "buffer #{i} `{}` is placed in the shared `activations` arena, but it must persist ({})",
                name(i),
                why.describe(plan)
            )));
        }
    }
    for kind in ArenaKind::ALL {
        let list = &mut members[kind.index()];
        list.sort_unstable();
        for (k, &(start, end, i)) in list.iter().enumerate() {
            // Sorted by offset: the buffers after `k` that start before `end` overlap it.
            for &(start2, end2, j) in list[k + 1..].iter().take_while(|x| x.0 < end) {
                let (lo, hi) = (start.max(start2), end.min(end2));
                let where_ = format!("bytes [{lo}, {hi}) of arena `{kind}`");
                let (ri, rj) = (residency[i].live_range(), residency[j].live_range());
                match (kind, ri, rj) {
                    (ArenaKind::Activations, Some(ri), Some(rj)) => {
                        if let Some(e) = carried.and_then(|head| {
                            crate::tiers::carried_clash(plan, head, &carried_src, (i, ri), (j, rj))
                        }) {
                            return Err(invalid(format!("{e}, and shares {where_}")));
                        }
                        if ri.overlaps(&rj) {
                            let at = ri.first.max(rj.first);
                            return Err(invalid(format!(
                                "buffers #{i} `{}` (live {}..{}) and #{j} `{}` (live {}..{}) are both live at {} but share {where_}",
                                name(i),
                                plan.step_position(ri.first),
                                plan.step_position(ri.last),
                                name(j),
                                plan.step_position(rj.first),
                                plan.step_position(rj.last),
                                plan.step_position(at),
                            )));
                        }
                    }
                    _ => {
                        return Err(invalid(format!(
                            "buffers #{i} `{}` and #{j} `{}` share {where_}; buffers of the persistent arena never share bytes",
                            name(i),
                            name(j)
                        )))
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::{
        Corpus, DType, DataPlan, Init, ParamRef, TargetPlan, Tokenizer, TrainPlan, PLAN_FORMAT,
        PLAN_VERSION,
    };

    fn buf(name: &str, shape: &[usize], dtype: DType, class: BufferClass) -> Buffer {
        Buffer {
            name: name.into(),
            shape: shape.to_vec(),
            dtype,
            class,
            init: Init::Zeros,
        }
    }

    /// A one-matmul language model: embedding, tied head, cross-entropy, AdamW.
    pub(crate) fn plan() -> Plan {
        use BufferClass::*;
        let b = |i: u32| BufferId(i);
        let buffers = vec![
            buf("tokens", &[2], DType::I32, Input),           // 0
            buf("targets", &[2], DType::I32, Input),          // 1
            buf("wte", &[3, 2], DType::F32, Parameter),       // 2
            buf("grad.wte", &[3, 2], DType::F32, Gradient),   // 3
            buf("x", &[2, 2], DType::F32, Activation),        // 4
            buf("logits", &[2, 3], DType::F32, Activation),   // 5
            buf("loss", &[1], DType::F32, Scalar),            // 6
            buf("d.logits", &[2, 3], DType::F32, Activation), // 7
            buf("m", &[3, 2], DType::F32, ExpAvg),            // 8
            buf("v", &[3, 2], DType::F32, ExpAvgSq),          // 9
            buf("unused", &[4], DType::F32, Activation),      // 10
        ];
        let memory = MemoryPlan::unshared(&buffers);
        Plan {
            format: PLAN_FORMAT.into(),
            version: PLAN_VERSION,
            name: "t".into(),
            buffers,
            params: vec![ParamRef {
                param: b(2),
                grad: b(3),
            }],
            loss: b(6),
            forward: vec![
                Op::Embedding {
                    table: b(2),
                    ids: b(0),
                    out: b(4),
                },
                Op::MatMul {
                    a: b(4),
                    b: b(2),
                    out: b(5),
                    trans_a: false,
                    trans_b: true,
                    accumulate: false,
                    micro_accumulate: None,
                },
                Op::CrossEntropy {
                    logits: b(5),
                    targets: b(1),
                    loss: b(6),
                },
            ],
            backward: vec![
                Op::CrossEntropyBackward {
                    logits: b(5),
                    targets: b(1),
                    dlogits: b(7),
                },
                Op::MatMul {
                    a: b(7),
                    b: b(4),
                    out: b(3),
                    trans_a: true,
                    trans_b: false,
                    accumulate: false,
                    micro_accumulate: None,
                },
            ],
            optimizer: vec![Op::AdamW {
                param: b(2),
                grad: b(3),
                exp_avg: b(8),
                exp_avg_sq: b(9),
                grad_scale: None,
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.0,
                on_host: false,
            }],
            host_tasks: vec![],
            data: DataPlan {
                corpus: Corpus::Builtin,
                tokenizer: Tokenizer::Bytes,
                batch_size: 1,
                seq_len: 2,
                val_fraction: 0.1,
                tokens: b(0),
                targets: b(1),
            },
            train: TrainPlan {
                steps: 1,
                warmup_steps: 0,
                min_lr_ratio: 0.1,
                eval_interval: 0,
                eval_batches: 1,
                seed: 1,
                rematerialize: Default::default(),
                max_skipped_steps: Some(10),
                refresh_swap: Default::default(),
                grad_accum: 1,
            },
            target: TargetPlan::Cpu {
                threads: Some(1),
                staleness: 0,
                eigensolver: crate::Eigensolver::Faer,
            },
            memory,
            model: None,
        }
    }

    #[test]
    fn plans_round_trip_and_old_versions_are_named() {
        let p = plan();
        assert_eq!(Plan::from_json(&p.to_json()), Ok(p.clone()));
        let mut v: serde_json::Value = serde_json::from_str(&p.to_json()).expect("json");
        v["version"] = serde_json::json!(1);
        v.as_object_mut().expect("object").remove("memory");
        let e = Plan::from_json(&v.to_string()).expect_err("version 1");
        assert_eq!(
            e,
            PlanError::Version {
                format: PLAN_FORMAT.into(),
                version: 1
            }
        );
        assert!(
            e.to_string().contains(&format!("version {PLAN_VERSION}")),
            "{e}"
        );
        v["version"] = serde_json::json!(PLAN_VERSION);
        let e = Plan::from_json(&v.to_string()).expect_err("no memory section");
        assert!(e.to_string().contains("missing field `memory`"), "{e}");
    }

    #[test]
    fn align_up_rounds_and_saturates() {
        assert_eq!(align_up(0, 256), 0);
        assert_eq!(align_up(1, 256), 256);
        assert_eq!(align_up(256, 256), 256);
        assert_eq!(align_up(257, 256), 512);
        assert_eq!(align_up(usize::MAX, 256) % 256, 0);
    }

    #[test]
    fn accesses_mark_outputs_and_in_place_updates() {
        let p = plan();
        let acc = |op: &Op| -> Vec<(&'static str, Access)> {
            op.accesses().into_iter().map(|(n, _, a)| (n, a)).collect()
        };
        assert_eq!(
            acc(&p.forward[1]),
            vec![
                ("a", Access::Read),
                ("b", Access::Read),
                ("out", Access::Write)
            ]
        );
        let mut acc_mm = p.forward[1].clone();
        if let Op::MatMul { accumulate, .. } = &mut acc_mm {
            *accumulate = true;
        }
        assert_eq!(acc(&acc_mm)[2], ("out", Access::ReadWrite));
        assert_eq!(
            acc(&p.optimizer[0]),
            vec![
                ("param", Access::ReadWrite),
                ("grad", Access::Read),
                ("exp_avg", Access::ReadWrite),
                ("exp_avg_sq", Access::ReadWrite),
            ]
        );
        let clip = Op::ClipGradNorm {
            grads: vec![BufferId(3)],
            norm: BufferId(6),
            scale: None,
            max_norm: Some(1.0),
            partials: None,
        };
        assert_eq!(
            acc(&clip),
            vec![("grads", Access::ReadWrite), ("norm", Access::Write)]
        );
        // With a `scale` output (`fuse`'s clip-into-update) the gradients are only read.
        let clip = Op::ClipGradNorm {
            grads: vec![BufferId(3)],
            norm: BufferId(6),
            scale: Some(BufferId(7)),
            max_norm: Some(1.0),
            partials: None,
        };
        assert_eq!(
            acc(&clip),
            vec![
                ("grads", Access::Read),
                ("norm", Access::Write),
                ("scale", Access::Write)
            ]
        );
        assert_eq!(acc(&p.forward[2])[2], ("loss", Access::Write));
    }

    #[test]
    fn residency_follows_the_rules() {
        let p = plan();
        p.verify().expect("valid");
        let r = p.residency();
        let t = |first, last| Residency::Transient(LiveRange { first, last });
        use PersistReason as W;
        assert_eq!(r[0], Residency::Persistent(W::DataInput));
        assert_eq!(r[2], Residency::Persistent(W::Parameter));
        assert_eq!(r[3], t(4, 5), "grad.wte: weight-gradient matmul .. AdamW");
        assert_eq!(r[4], t(0, 4), "x: embedding .. weight-gradient matmul");
        assert_eq!(r[5], t(1, 3), "logits: head .. cross-entropy backward");
        assert_eq!(r[6], Residency::Persistent(W::Loss));
        assert_eq!(r[7], t(3, 4));
        assert_eq!(r[8], Residency::Persistent(W::Class(BufferClass::ExpAvg)));
        assert_eq!(r[10], Residency::Persistent(W::Unused));
        assert_eq!(p.step_position(3), "backward[0]");
        assert_eq!(p.step_position(5), "optimizer[0]");
        assert_eq!(p.step_position_of("backward", 1), 4);
        // Peak: x + logits + d.logits at backward[0] = 16 + 24 + 24 bytes (and x + d.logits +
        // grad.wte at backward[1]).
        assert_eq!(p.peak_live_bytes(&r), 64);
    }

    fn shared(p: &mut Plan, slots: &[(usize, usize)], bytes: usize) {
        p.memory.arenas.push(ArenaPlan {
            kind: ArenaKind::Activations,
            bytes,
        });
        for &(i, offset) in slots {
            p.memory.slots[i] = BufferSlot {
                arena: ArenaKind::Activations,
                offset,
            };
        }
    }

    #[test]
    fn verify_checks_the_memory_plan() {
        // logits (1..=3) and d.logits (3..=4) are live together at backward[0]; x (0..=4)
        // overlaps both.
        let mut p = plan();
        shared(&mut p, &[(4, 0), (5, 256), (7, 512)], 768);
        p.verify().expect("disjoint bytes");
        let mut p = plan();
        shared(&mut p, &[(4, 0), (5, 256), (7, 256)], 512);
        let e = p
            .verify()
            .expect_err("logits and d.logits share bytes")
            .to_string();
        assert!(
            e.starts_with("memory plan: ")
                && e.contains("`logits` (live forward[1]..backward[0])")
                && e.contains("`d.logits` (live backward[0]..backward[1])")
                && e.contains("both live at backward[0]")
                && e.contains("bytes [256, 280) of arena `activations`"),
            "{e}"
        );
        let mut p = plan();
        shared(&mut p, &[(6, 0)], 256);
        let e = p
            .verify()
            .expect_err("the loss is not step-local")
            .to_string();
        assert!(
            e.contains("`loss`") && e.contains("must persist (the loss)"),
            "{e}"
        );
        let mut p = plan();
        shared(&mut p, &[(5, 0)], 256);
        p.memory.slots[5].offset = 128;
        assert!(p
            .verify()
            .expect_err("misaligned")
            .to_string()
            .contains("not a multiple of the 256-byte alignment"));
        p.memory.slots[5].offset = 256;
        assert!(p
            .verify()
            .expect_err("outside")
            .to_string()
            .contains("(24 bytes at offset 256) does not fit in arena `activations` of 256 bytes"));
        let mut p = plan();
        p.memory.slots[3] = p.memory.slots[2];
        let e = p
            .verify()
            .expect_err("two parameters-state buffers")
            .to_string();
        assert!(
            e.contains("`wte` and #3 `grad.wte` share bytes [512, 536) of arena `persistent`"),
            "{e}"
        );
    }
}
