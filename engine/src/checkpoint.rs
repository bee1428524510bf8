//! Checkpoints of a training run: the whole state a run needs to continue exactly, written
//! atomically, checked before use.
//!
//! # What a checkpoint holds
//! A directory `step-NNNNNNNNN` (the step it was taken after) with:
//! - `state.safetensors`: every state buffer of the plan — parameters (fp32 master weights),
//!   Adam moments, Kronecker factors and eigenbases, whatever tier they live in — as F32
//!   tensors under their plan names ([`state_buffers`]);
//! - `plan.json`: the plan that wrote it (what `asteria sample` runs the weights with);
//! - `meta.json` ([`CheckpointMeta`]): the format and version, the step, the number of
//!   training batches drawn (the data position: the sampler is replayed that far on resume),
//!   the seed, the hash of the plan's state layout ([`state_hash`]), per refresh task whether its
//!   first eigendecomposition succeeded, the failure counters and skipped steps, and a CRC32 of
//!   every tensor's bytes.
//!
//! Refreshes in flight (staleness S > 0): the CPU engine records each one in flight — its
//! task, launch step and the factor and basis snapshots it computes from
//! (`in_flight.safetensors`, CRC32s in `meta.json`) — and a resumed run recomputes it from them
//! and puts it back in flight. With the plan's `refresh_swap = deadline` (every refresh
//! installed exactly S steps after its launch) the resumed run replays the uninterrupted one bit for bit;
//! by default a result is swapped in when it is finished, which depends on timing, and the
//! resume continues the run within the same bounds. The CUDA engine drains its refreshes
//! before a checkpoint instead, each installed at the checkpoint's step, within its bound.
//!
//! # Atomicity
//! Both files are written into `step-N.tmp-PID`, fsynced, the directory renamed to `step-N`
//! and its parent fsynced: a crash (or `kill -9`) mid-write leaves a `.tmp-*` directory that
//! [`latest`] ignores and the previous checkpoint intact. Only the newest `keep` checkpoints are
//! kept.
//!
//! # Checks on load
//! A missing or unparsable file, another format version, a tensor whose CRC32 or size does not
//! match, a state layout of another model or optimizer (the hash and the first differing
//! tensor are named), or another number of refresh tasks is refused with
//! [`EngineError::Checkpoint`] before anything is written into the engine. The hash covers the
//! names, shapes and dtypes of the state buffers only, so a run may resume with another
//! `staleness`, tier budget, learning rate or number of steps.
use crate::train::StepExecutor;
use crate::EngineError;
use schedule::{ArenaKind, BufferClass, DType, Op, Plan};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// `meta.json`'s `format`.
pub const FORMAT: &str = "asteria-checkpoint";
/// `meta.json`'s `version`.
pub const VERSION: u32 = 1;
const TENSORS: &str = "state.safetensors";
const META: &str = "meta.json";
const PLAN: &str = "plan.json";
const IN_FLIGHT: &str = "in_flight.safetensors";

/// One tensor's record in `meta.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Shape, as in the plan.
    pub shape: Vec<usize>,
    /// CRC32 of the tensor's little-endian f32 bytes.
    pub crc32: u32,
}

/// One refresh in flight in `meta.json`: its task, launch step and the CRC32 of its two
/// snapshots (`task{N}.factor`, `task{N}.basis` in `in_flight.safetensors`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InFlightMeta {
    /// Host task index in the plan.
    pub task: usize,
    /// The step at whose end it was launched.
    pub launched: u64,
    /// CRC32 of the factor snapshot's little-endian f32 bytes.
    pub factor_crc32: u32,
    /// CRC32 of the basis snapshot's bytes.
    pub basis_crc32: u32,
}

/// A refresh in flight at a checkpoint: the snapshots it computes from (row-major `d × d`,
/// f32 values as f64), so that a resumed run recomputes the same result and installs it at the
/// same step (the refresh's launch step plus its staleness).
#[derive(Clone, Debug, PartialEq)]
pub struct InFlightRefresh {
    /// Host task index in the plan.
    pub task: usize,
    /// The step at whose end it was launched.
    pub launched: u64,
    /// The Kronecker factor snapshot.
    pub factor: Vec<f64>,
    /// The eigenbasis snapshot.
    pub basis: Vec<f64>,
}

/// `meta.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// The plan's name (for messages).
    pub plan: String,
    /// [`state_hash`] of the plan that wrote it.
    pub state_hash: String,
    /// The last step run (1-based).
    pub step: u64,
    /// Training batches drawn so far (the data position).
    pub batches: u64,
    /// The batch those were drawn in, `(batch_size, seq_len)`: a resume that draws another
    /// shape would land elsewhere in the data and is refused (absent in older checkpoints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_shape: Option<(usize, usize)>,
    /// The data sampler's seed.
    pub seed: u64,
    /// Per refresh task: whether its first eigendecomposition succeeded.
    pub refreshes_initialized: Vec<bool>,
    /// Per refresh task: failed refreshes so far.
    pub refresh_failures: Vec<u64>,
    /// Per refresh task: failures in a row.
    pub consecutive_refresh_failures: Vec<u32>,
    /// Optimizer steps skipped for a non-finite gradient so far.
    pub skipped_steps: u64,
    /// Seconds of the run (its metrics' `wall_s`, across earlier resumes) when this was
    /// written: a resumed run's `wall_s` continues from it (absent in older checkpoints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wall_s: Option<f64>,
    /// Refreshes in flight at the checkpoint (engines that replay them, the CPU engine's):
    /// their snapshots are in `in_flight.safetensors`.
    #[serde(default)]
    pub in_flight: Vec<InFlightMeta>,
    /// Every tensor of `state.safetensors`.
    pub tensors: BTreeMap<String, TensorMeta>,
    /// CRC32 of this metadata's pretty JSON without this field ([`meta_crc32`]): a changed
    /// step, data position or counter is refused on load (absent in older checkpoints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meta_crc32: Option<u32>,
}

/// The CRC32 [`CheckpointMeta::meta_crc32`] holds: of `meta`'s pretty JSON with that field
/// left out (so the JSON's formatting does not matter, only its values).
pub fn meta_crc32(meta: &CheckpointMeta) -> Result<u32, EngineError> {
    let bare = CheckpointMeta {
        meta_crc32: None,
        ..meta.clone()
    };
    serde_json::to_vec_pretty(&bare)
        .map(|b| crc32fast::hash(&b))
        .map_err(|e| err(format!("meta.json: {e}")))
}

/// A checkpoint read back and verified.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// Where it was read from.
    pub dir: PathBuf,
    /// Its metadata.
    pub meta: CheckpointMeta,
    /// Its tensors by name (f32 values).
    pub tensors: BTreeMap<String, Vec<f32>>,
    /// The plan that wrote it (`plan.json`; what `asteria sample` runs), when present.
    pub plan: Option<Plan>,
    /// Its refreshes in flight (empty when the engine drained them).
    pub in_flight: Vec<InFlightRefresh>,
}

fn err(what: impl std::fmt::Display) -> EngineError {
    EngineError::Checkpoint(what.to_string())
}

/// The plan's state buffers, in plan order: every f32 buffer that lives across steps
/// (persistent, host or NVMe arena) and is a parameter, moment, Kronecker factor or eigenbasis.
pub fn state_buffers(plan: &Plan) -> Vec<&schedule::Buffer> {
    plan.buffers
        .iter()
        .enumerate()
        .filter(|(i, b)| {
            let arena = plan.memory.tier(schedule::BufferId(*i as u32));
            b.dtype == DType::F32
                && arena.is_some_and(|k| k != ArenaKind::Activations)
                && matches!(
                    b.class,
                    BufferClass::Parameter
                        | BufferClass::ExpAvg
                        | BufferClass::ExpAvgSq
                        | BufferClass::KroneckerFactor
                        | BufferClass::Eigenbasis
                        | BufferClass::EigenvalueEstimate
                        | BufferClass::InverseRoot
                )
        })
        .map(|(_, b)| b)
        .collect()
}

/// A hash of the plan's state layout (names, shapes, classes of [`state_buffers`], and the
/// number of refresh tasks): equal for the same model and optimizer whatever the run options.
pub fn state_hash(plan: &Plan) -> String {
    let mut h = crc32fast::Hasher::new();
    let mut h2 = crc32fast::Hasher::new_with_initial(0x9e37_79b9);
    // A host update's device copy (`Init::CopyOf`) is derived state: checkpoints of runs with
    // and without `host_updates` resume into each other (`restore` fills a missing one from
    // its source).
    for b in state_buffers(plan)
        .into_iter()
        .filter(|b| !matches!(b.init, schedule::Init::CopyOf { .. }))
    {
        let line = format!("{}|{:?}|{:?};", b.name, b.shape, b.class);
        h.update(line.as_bytes());
        h2.update(line.as_bytes());
    }
    let tasks = format!("tasks {}", plan.host_tasks.len());
    h.update(tasks.as_bytes());
    h2.update(tasks.as_bytes());
    format!("{:08x}{:08x}", h.finalize(), h2.finalize())
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A safetensors file of F32 tensors `(name, shape, values)` with optional header metadata
/// (checkpoints, `asteria export`).
///
/// # Errors
/// [`EngineError::Checkpoint`] when a tensor's values do not fill its shape.
pub(crate) fn f32_safetensors<'a>(
    tensors: impl IntoIterator<Item = (String, Vec<usize>, &'a [f32])>,
    metadata: Option<std::collections::HashMap<String, String>>,
) -> Result<Vec<u8>, EngineError> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, v)| (n, s, f32_bytes(v)))
        .collect();
    let views = bytes
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| err(format!("tensor `{n}`: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize(views, metadata).map_err(|e| err(format!("safetensors: {e}")))
}

fn fsync_dir(dir: &Path) -> Result<(), EngineError> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| err(format!("fsync {}: {e}", dir.display())))
}

/// The directory name of the checkpoint after `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:09}")
}

/// Writes the checkpoint of `engine` after step `step` (`batches` training batches drawn,
/// sampler seed `seed`, `wall_s` seconds of the run so far) into `root/step-N`, atomically, draining refreshes in flight first;
/// then removes the oldest others until `keep` checkpoints remain in `root` (the new one
/// always stays). Returns the directory.
///
/// # Errors
/// [`EngineError::Checkpoint`] on an I/O error (the message names the path); the engine's
/// errors reading its state.
pub fn save<E: StepExecutor + ?Sized>(
    engine: &mut E,
    root: &Path,
    step: u64,
    batches: u64,
    seed: u64,
    keep: usize,
    wall_s: f64,
) -> Result<PathBuf, EngineError> {
    let in_flight = engine.checkpoint_refreshes(step)?;
    let plan = engine.plan().clone();
    let mut tensors: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    let mut metas = BTreeMap::new();
    for b in state_buffers(&plan) {
        let v: Vec<f32> = engine
            .read_state(&b.name)?
            .into_iter()
            .map(|x| x as f32)
            .collect();
        metas.insert(
            b.name.clone(),
            TensorMeta {
                shape: b.shape.clone(),
                crc32: crc32fast::hash(&f32_bytes(&v)),
            },
        );
        tensors.insert(b.name.clone(), v);
    }
    let stats = engine.stats().clone();
    let meta = CheckpointMeta {
        format: FORMAT.into(),
        version: VERSION,
        plan: plan.name.clone(),
        state_hash: state_hash(&plan),
        step,
        batches,
        batch_shape: Some((plan.data.batch_size, plan.data.seq_len)),
        seed,
        refreshes_initialized: engine.refreshes_initialized(),
        refresh_failures: stats.refresh_failures.clone(),
        consecutive_refresh_failures: stats.consecutive_refresh_failures.clone(),
        skipped_steps: stats.skipped_steps,
        wall_s: Some(wall_s),
        in_flight: Vec::new(),
        tensors: metas,
        meta_crc32: None,
    };
    let mut meta = meta;
    let mut flight: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    for r in &in_flight {
        let f: Vec<f32> = r.factor.iter().map(|&x| x as f32).collect();
        let b: Vec<f32> = r.basis.iter().map(|&x| x as f32).collect();
        meta.in_flight.push(InFlightMeta {
            task: r.task,
            launched: r.launched,
            factor_crc32: crc32fast::hash(&f32_bytes(&f)),
            basis_crc32: crc32fast::hash(&f32_bytes(&b)),
        });
        flight.insert(format!("task{}.factor", r.task), f);
        flight.insert(format!("task{}.basis", r.task), b);
    }
    std::fs::create_dir_all(root).map_err(|e| err(format!("{}: {e}", root.display())))?;
    let name = step_dir_name(step);
    let tmp = root.join(format!("{name}.tmp-{}", std::process::id()));
    let done = root.join(&name);
    let io = |p: &Path, e: std::io::Error| err(format!("{}: {e}", p.display()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    std::fs::create_dir(&tmp).map_err(|e| io(&tmp, e))?;
    let st = f32_safetensors(
        tensors
            .iter()
            .map(|(n, v)| (n.clone(), metas_shape(&meta, n), v.as_slice())),
        None,
    )?;
    let mut files = Vec::new();
    if !flight.is_empty() {
        files.push((
            IN_FLIGHT,
            f32_safetensors(
                flight
                    .iter()
                    .map(|(n, v)| (n.clone(), vec![v.len()], v.as_slice())),
                None,
            )?,
        ));
    }
    for (file, data) in files.into_iter().chain([
        (TENSORS, st),
        (META, {
            meta.meta_crc32 = Some(meta_crc32(&meta)?);
            serde_json::to_vec_pretty(&meta).map_err(|e| err(format!("meta.json: {e}")))?
        }),
        (PLAN, plan.to_json().into_bytes()),
    ]) {
        let p = tmp.join(file);
        let mut f = std::fs::File::create(&p).map_err(|e| io(&p, e))?;
        f.write_all(&data)
            .and_then(|_| f.sync_all())
            .map_err(|e| io(&p, e))?;
    }
    fsync_dir(&tmp)?;
    if done.exists() {
        std::fs::remove_dir_all(&done).map_err(|e| io(&done, e))?;
    }
    std::fs::rename(&tmp, &done).map_err(|e| io(&done, e))?;
    fsync_dir(root)?;
    // Keep the newest `keep` by step, never the one just written (a run resumed from an older
    // checkpoint writes below newer ones).
    let mut others: Vec<PathBuf> = list(root)?
        .into_iter()
        .map(|(_, p)| p)
        .filter(|p| *p != done)
        .collect();
    while others.len() + 1 > keep.max(1) {
        let old = others.remove(0);
        std::fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
    }
    tracing::info!(dir = %done.display(), step, "checkpoint written");
    Ok(done)
}

fn metas_shape(meta: &CheckpointMeta, name: &str) -> Vec<usize> {
    meta.tensors
        .get(name)
        .map(|t| t.shape.clone())
        .unwrap_or_default()
}

/// The complete checkpoints in `root` (`step-N` directories with a `meta.json`), oldest first.
fn list(root: &Path) -> Result<Vec<(u64, PathBuf)>, EngineError> {
    let rd = std::fs::read_dir(root).map_err(|e| err(format!("{}: {e}", root.display())))?;
    let mut out = Vec::new();
    for entry in rd.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let Some(n) = name.strip_prefix("step-") else {
            continue;
        };
        if let Ok(step) = n.parse::<u64>() {
            if entry.path().join(META).is_file() {
                out.push((step, entry.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Checks before a run's first step that checkpoints can be written into `root`: creates it
/// (and its parents) when missing, and writes and removes a probe file in it, so that a bad
/// `--checkpoint-dir` stops the run at its start rather than at its first checkpoint.
///
/// # Errors
/// [`EngineError::Checkpoint`] naming `root`: not a directory, cannot be created, not
/// writable.
pub fn prepare_root(root: &Path) -> Result<(), EngineError> {
    if root.exists() && !root.is_dir() {
        return Err(err(format!(
            "--checkpoint-dir {} exists and is not a directory",
            root.display()
        )));
    }
    std::fs::create_dir_all(root).map_err(|e| {
        err(format!(
            "--checkpoint-dir {}: cannot create it: {e}",
            root.display()
        ))
    })?;
    let probe = root.join(format!(".asteria-write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"probe").map_err(|e| {
        err(format!(
            "--checkpoint-dir {}: cannot write into it: {e}",
            root.display()
        ))
    })?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// The `step-N` directories of `root` newer than the checkpoint `chosen` that are not
/// complete checkpoints (no `meta.json`): a resume that takes the newest complete one names
/// them. Empty when `root` is itself a checkpoint or cannot be read.
pub fn incomplete_newer(root: &Path, chosen_step: u64) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut out: Vec<(u64, PathBuf)> = rd
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let step = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            (step > chosen_step && e.path().is_dir() && !e.path().join(META).is_file())
                .then(|| (step, e.path()))
        })
        .collect();
    out.sort();
    out.into_iter().map(|(_, p)| p).collect()
}

/// The newest complete checkpoint in `dir`, or `dir` itself when it is one.
///
/// # Errors
/// [`EngineError::Checkpoint`] when `dir` holds none.
pub fn latest(dir: &Path) -> Result<PathBuf, EngineError> {
    if dir.join(META).is_file() {
        return Ok(dir.to_path_buf());
    }
    list(dir)?.pop().map(|(_, p)| p).ok_or_else(|| {
        err(format!(
            "{} holds no checkpoint (no step-N directory with a meta.json)",
            dir.display()
        ))
    })
}

/// Reads and verifies the checkpoint at `dir` (a `step-N` directory, or a checkpoint
/// directory: its newest): format, version, every tensor's size and CRC32.
///
/// # Errors
/// [`EngineError::Checkpoint`] naming the file and what is wrong.
pub fn load(dir: &Path) -> Result<Checkpoint, EngineError> {
    let dir = latest(dir)?;
    let mp = dir.join(META);
    let raw = std::fs::read(&mp).map_err(|e| err(format!("{}: {e}", mp.display())))?;
    let meta: CheckpointMeta = serde_json::from_slice(&raw).map_err(|e| {
        err(format!(
            "{}: not a checkpoint's metadata: {e}",
            mp.display()
        ))
    })?;
    if meta.format != FORMAT || meta.version != VERSION {
        return Err(err(format!(
            "{}: format `{}` version {}, this asteria reads `{FORMAT}` version {VERSION}",
            mp.display(),
            meta.format,
            meta.version
        )));
    }
    if let Some(want) = meta.meta_crc32 {
        if meta_crc32(&meta)? != want {
            return Err(err(format!(
                "{}: fails its checksum (its step, data position or counters were changed \
                 or damaged)",
                mp.display()
            )));
        }
    }
    let tp = dir.join(TENSORS);
    let raw = std::fs::read(&tp).map_err(|e| err(format!("{}: {e}", tp.display())))?;
    let st = safetensors::SafeTensors::deserialize(&raw)
        .map_err(|e| err(format!("{}: corrupt or truncated: {e}", tp.display())))?;
    let mut tensors = BTreeMap::new();
    for (name, tm) in &meta.tensors {
        let view = st
            .tensor(name)
            .map_err(|e| err(format!("{}: tensor `{name}` is missing: {e}", tp.display())))?;
        let numel: usize = tm.shape.iter().product();
        if view.dtype() != safetensors::Dtype::F32
            || view.shape() != tm.shape.as_slice()
            || view.data().len() != numel * 4
        {
            return Err(err(format!(
                "{}: tensor `{name}` is {:?} {:?}, meta.json says F32 {:?}",
                tp.display(),
                view.dtype(),
                view.shape(),
                tm.shape
            )));
        }
        if crc32fast::hash(view.data()) != tm.crc32 {
            return Err(err(format!(
                "{}: tensor `{name}` fails its checksum (the file is corrupt)",
                tp.display()
            )));
        }
        let v: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        tensors.insert(name.clone(), v);
    }
    // The plan (checkpoints written before 2026-12-02 have none: then `None`); a corrupt one
    // is refused like a corrupt tensor.
    let pp = dir.join(PLAN);
    let plan = match std::fs::read_to_string(&pp) {
        Ok(text) => Some(
            Plan::from_json(&text)
                .map_err(|e| err(format!("{}: not a valid plan: {e}", pp.display())))?,
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(err(format!("{}: {e}", pp.display()))),
    };
    let mut in_flight = Vec::new();
    if !meta.in_flight.is_empty() {
        let fp = dir.join(IN_FLIGHT);
        let raw = std::fs::read(&fp).map_err(|e| err(format!("{}: {e}", fp.display())))?;
        let st = safetensors::SafeTensors::deserialize(&raw)
            .map_err(|e| err(format!("{}: corrupt or truncated: {e}", fp.display())))?;
        let read = |name: String, crc: u32| -> Result<Vec<f64>, EngineError> {
            let view = st
                .tensor(&name)
                .map_err(|e| err(format!("{}: `{name}` is missing: {e}", fp.display())))?;
            if view.dtype() != safetensors::Dtype::F32 || crc32fast::hash(view.data()) != crc {
                return Err(err(format!(
                    "{}: `{name}` fails its checksum (the file is corrupt)",
                    fp.display()
                )));
            }
            Ok(view
                .data()
                .chunks_exact(4)
                .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect())
        };
        for m in &meta.in_flight {
            in_flight.push(InFlightRefresh {
                task: m.task,
                launched: m.launched,
                factor: read(format!("task{}.factor", m.task), m.factor_crc32)?,
                basis: read(format!("task{}.basis", m.task), m.basis_crc32)?,
            });
        }
    }
    Ok(Checkpoint {
        dir,
        meta,
        tensors,
        plan,
        in_flight,
    })
}

/// Checks that `ckpt` fits `plan` (its state layout and refresh tasks) without changing
/// anything.
///
/// # Errors
/// [`EngineError::Checkpoint`] naming the first tensor that differs.
pub fn check(ckpt: &Checkpoint, plan: &Plan) -> Result<(), EngineError> {
    let want = state_hash(plan);
    if ckpt.meta.state_hash == want {
        return match &ckpt.plan {
            Some(there) => same_hyperparameters(ckpt, there, plan),
            None => Ok(()),
        };
    }
    let mine = state_buffers(plan);
    let first = mine
        .iter()
        .find(|b| ckpt.meta.tensors.get(&b.name).map(|t| &t.shape) != Some(&b.shape))
        .map(|b| match ckpt.meta.tensors.get(&b.name) {
            Some(t) => format!("`{}` is {:?} here and {:?} there", b.name, b.shape, t.shape),
            None => format!("`{}` is not in the checkpoint", b.name),
        })
        .or_else(|| {
            ckpt.meta
                .tensors
                .keys()
                .find(|n| !mine.iter().any(|b| &b.name == *n))
                .map(|n| format!("the checkpoint's `{n}` is not in this plan"))
        })
        .unwrap_or_else(|| "the refresh tasks differ".into());
    let optimizer = |p: &Plan| {
        p.optimizer
            .iter()
            .map(Op::name)
            .find(|n| !matches!(*n, "clip_grad_norm" | "copy_in" | "copy_out"))
            .unwrap_or("none")
    };
    let there = ckpt.plan.as_ref().map_or("unknown", optimizer);
    Err(err(format!(
        "{} was written by plan `{}` with another model or optimizer ({first}; its optimizer \
         op `{there}`, here `{}`); state hash {} there, {want} here",
        ckpt.dir.display(),
        ckpt.meta.plan,
        optimizer(plan),
        ckpt.meta.state_hash
    )))
}

/// The optimizer ops' hyperparameters with the peak learning rate left out (a resume may
/// change the lr schedule; `--resume`'s help says what may differ), then the inverse roots'
/// of the refresh tasks (Shampoo's ε lives only there in a composed plan).
fn hyperparameters(plan: &Plan) -> Vec<(&'static str, String)> {
    let roots = plan.host_tasks.iter().filter_map(|task| {
        let schedule::HostTask::EigenbasisRefresh { root, .. } = task;
        root.map(|r| {
            let text = format!("exponent {}, epsilon {:?}", r.exponent, r.epsilon);
            ("eigenbasis_refresh", text)
        })
    });
    plan.optimizer
        .iter()
        .filter_map(|op| {
            let text = match op {
                Op::AdamW {
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                    ..
                } => format!(
                    "beta1 {beta1:?}, beta2 {beta2:?}, eps {eps:?}, weight_decay {weight_decay:?}"
                ),
                Op::SoapUpdate { hyper, .. } => {
                    format!("{:?}", schedule::SoapHyper { lr: 0.0, ..*hyper })
                }
                Op::KlShampooUpdate { hyper, .. } => {
                    format!("{:?}", schedule::KlShampooHyper { lr: 0.0, ..*hyper })
                }
                Op::ShampooUpdate { hyper, .. } => {
                    format!("{:?}", schedule::ShampooHyper { lr: 0.0, ..*hyper })
                }
                Op::SoapFactorUpdate { shampoo_beta, .. } => {
                    format!("shampoo_beta {shampoo_beta:?}")
                }
                Op::KlFactorUpdate {
                    shampoo_beta,
                    init_factor,
                    max_clamp_value,
                    ..
                } => format!(
                    "shampoo_beta {shampoo_beta:?}, init_factor {init_factor:?}, \
                     max_clamp_value {max_clamp_value:?}"
                ),
                Op::KlScale { eps, .. } => format!("eps {eps:?}"),
                Op::ShampooFactorUpdate {
                    beta2,
                    use_bias_correction,
                    max_preconditioner_dim,
                    ..
                } => format!(
                    "beta2 {beta2:?}, use_bias_correction {use_bias_correction}, \
                     max_preconditioner_dim {max_preconditioner_dim}"
                ),
                Op::ElementwiseUpdate { rule, .. } => {
                    format!("{} {:?} {}", rule.optimizer, rule.scalars, rule.expr)
                }
                Op::ClipGradNorm { max_norm, .. } => format!("max_norm {max_norm:?}"),
                _ => return None,
            };
            Some((op.name(), text))
        })
        .chain(roots)
        .collect()
}

/// A checkpoint of the same state layout but other optimizer hyperparameters (betas, ε, weight
/// decay, clipping, ...: everything but the lr) is refused, naming the first that differs:
/// resuming would silently continue another optimization.
fn same_hyperparameters(ckpt: &Checkpoint, there: &Plan, here: &Plan) -> Result<(), EngineError> {
    let (a, b) = (hyperparameters(there), hyperparameters(here));
    // The same in another order is the same optimizer (`host_updates` orders a program's
    // updates by their gradients' completion); otherwise the first that differs is named.
    let (mut sa, mut sb) = (a.clone(), b.clone());
    sa.sort();
    sb.sort();
    if sa == sb {
        return Ok(());
    }
    match a.iter().zip(&b).find(|(x, y)| x != y) {
        None if a.len() == b.len() => Ok(()),
        found => {
            let what = match found {
                Some(((op, x), (_, y))) => format!("`{op}`: {x} there, {y} here"),
                None => format!("{} optimizer ops there, {} here", a.len(), b.len()),
            };
            Err(err(format!(
                "{} was written with other optimizer hyperparameters ({what}); a resume may \
                 change the lr, steps, staleness and budgets, not the optimizer",
                ckpt.dir.display()
            )))
        }
    }
}

/// Writes `ckpt`'s state into `engine` (after [`check`]): every tensor, the refresh tasks'
/// first-basis flags, the failure counters and skipped steps.
///
/// # Errors
/// [`check`]'s; the engine's errors writing its state.
pub fn restore<E: StepExecutor + ?Sized>(
    engine: &mut E,
    ckpt: &Checkpoint,
) -> Result<(), EngineError> {
    check(ckpt, engine.plan())?;
    // Device copies (`Init::CopyOf`, `host_updates`): a checkpoint of a run without them
    // fills each from its source; one of a run with them, resumed without, has extra ones.
    let copies: Vec<(String, String)> = {
        let plan = engine.plan();
        plan.buffers
            .iter()
            .filter_map(|b| match b.init {
                schedule::Init::CopyOf { of } => {
                    Some((b.name.clone(), plan.buffer(of).name.clone()))
                }
                _ => None,
            })
            .collect()
    };
    let here: std::collections::HashSet<String> = state_buffers(engine.plan())
        .into_iter()
        .map(|b| b.name.clone())
        .collect();
    for (name, v) in &ckpt.tensors {
        if !here.contains(name) {
            continue; // a device copy of a `host_updates` run (the state hashes matched)
        }
        let values: Vec<f64> = v.iter().map(|&x| f64::from(x)).collect();
        engine.write_state(name, &values)?;
    }
    for (copy, of) in &copies {
        if !ckpt.tensors.contains_key(copy) {
            if let Some(v) = ckpt.tensors.get(of) {
                let values: Vec<f64> = v.iter().map(|&x| f64::from(x)).collect();
                engine.write_state(copy, &values)?;
            }
        }
    }
    engine.set_refreshes_initialized(&ckpt.meta.refreshes_initialized)?;
    let tasks = ckpt.meta.refreshes_initialized.len();
    let stats = engine.stats_mut()?;
    if ckpt.meta.refresh_failures.len() == tasks
        && ckpt.meta.consecutive_refresh_failures.len() == tasks
    {
        stats.refresh_failures = ckpt.meta.refresh_failures.clone();
        stats.consecutive_refresh_failures = ckpt.meta.consecutive_refresh_failures.clone();
    }
    stats.skipped_steps = ckpt.meta.skipped_steps;
    engine.restore_refreshes(&ckpt.in_flight)
}
