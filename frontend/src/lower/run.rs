//! The blocks around the model: `data { ... }` (corpus, tokenizer, batch shape), `train { ... }`
//! (schedule, clipping, evaluation) and `target <cpu|cuda> { ... }`.

use std::path::Path;

use ir::config::{CorpusConfig, DataConfig, TargetConfig, TokenizerKind, TrainConfig};

use super::{block_name, missing_name, no_name, TOKENIZERS};
use crate::ast::{Block, Value, ValueKind};
use crate::check::{unknown_name, Checker, Fields};
use crate::diagnostics::SpecError;
use crate::files::{check_corpus_path, check_shard_path};
use ir::limits;

const DATA_KEYS: &[&str] = &[
    "corpus",
    "train",
    "val",
    "tokenizer",
    "batch_size",
    "seq_len",
    "val_fraction",
];
const TRAIN_KEYS: &[&str] = &[
    "steps",
    "warmup",
    "min_lr_ratio",
    "grad_clip",
    "eval_interval",
    "eval_batches",
    "seed",
    "rematerialize",
    "max_skipped_steps",
    "refresh_swap",
    "grad_accum",
];
const TARGETS: &[&str] = &["cpu", "cuda"];

/// `data { ... }`: a text corpus (`corpus`, `tokenizer`) or llm.c token shards (`train`,
/// optionally `val`), and the batch shape.
pub(crate) fn data<'a>(c: &mut Checker, b: &'a Block, base_dir: &Path) -> (DataConfig, Fields<'a>) {
    no_name(c, b);
    let f = c.fields(b, "data", DATA_KEYS, &[]);
    let shards = shards(c, &f, base_dir);
    let corpus = match (&shards, f.get("corpus")) {
        (Some(s), _) => s.clone(),
        (None, None) => CorpusConfig::Builtin,
        (None, Some(e)) => corpus(c, &e.value, base_dir),
    };
    let tokenizer = match f.get("tokenizer") {
        None => Some("gpt2"),
        Some(e) => c.name_value("tokenizer", &e.value, "tokenizer", TOKENIZERS),
    };
    if let (Some(_), Some(t), Some("bytes")) = (&shards, f.get("tokenizer"), tokenizer) {
        let mut e = SpecError::new(
            "spec::tokenizer-mismatch",
            t.value.span,
            "token shards hold GPT-2 token ids; `tokenizer = bytes` cannot read them",
            "not the shards' tokenizer",
        )
        .with_help("remove `tokenizer` (shards imply `gpt2`), or train on a text `corpus`");
        if let Some(train) = f.get("train") {
            e = e.with_note(train.key.span, "shards given here");
        }
        c.push(e);
    }
    let config = DataConfig {
        corpus,
        tokenizer: if tokenizer == Some("bytes") {
            TokenizerKind::Bytes
        } else {
            TokenizerKind::Gpt2
        },
        batch_size: c
            .uint_req(&f, "batch_size", limits::BATCH_SIZE)
            .unwrap_or(1),
        seq_len: c.uint_req(&f, "seq_len", limits::SEQ_LEN).unwrap_or(1),
        val_fraction: c.float_or(&f, "val_fraction", limits::VAL_FRACTION, 0.1),
    };
    (config, f)
}

/// `train = "DIR/*train*.bin"` and `val = "DIR/*val*.bin"` (each a path, a glob pattern, or a
/// list of them): llm.c token shards, `None` when `train` is not set. `val` needs `train`;
/// `corpus` and `train` exclude each other; `val_fraction` does not apply with `val`.
fn shards(c: &mut Checker, f: &Fields, base_dir: &Path) -> Option<CorpusConfig> {
    let Some(train) = f.get("train") else {
        if let Some(v) = f.get("val") {
            c.push(
                SpecError::new(
                    "spec::missing-key",
                    v.key.span,
                    "`val` shards need `train` shards",
                    "no `train` in this block",
                )
                .with_help(
                    "add `train = \"DIR/*train*.bin\"`, or remove `val` (a text corpus holds \
                     out `val_fraction` of its tokens)",
                ),
            );
        }
        return None;
    };
    if let Some(corpus) = f.get("corpus") {
        c.push(
            SpecError::new(
                "spec::conflicting-keys",
                corpus.key.span,
                "`corpus` and `train` cannot both be set",
                "a text corpus",
            )
            .with_note(train.key.span, "token shards")
            .with_help(
                "`corpus` is text to tokenize; `train` / `val` are llm.c token shards: keep one",
            ),
        );
    }
    let val = f.get("val");
    if let (Some(vf), Some(v)) = (f.get("val_fraction"), val) {
        c.push(
            SpecError::new(
                "spec::conflicting-keys",
                vf.key.span,
                "`val_fraction` does not apply when `val` shards are given",
                "not used",
            )
            .with_note(v.key.span, "validation shards")
            .with_help("remove `val_fraction`: the validation split is the `val` shards"),
        );
    }
    let train = shard_list(c, "train", &train.value, base_dir);
    let val = val.map_or_else(Vec::new, |v| shard_list(c, "val", &v.value, base_dir));
    Some(CorpusConfig::Shards { train, val })
}

/// The files of a `train` / `val` value: a path or pattern string, or a non-empty list of them.
fn shard_list(c: &mut Checker, key: &str, v: &Value, base_dir: &Path) -> Vec<String> {
    let mut paths = Vec::new();
    let mut check = |c: &mut Checker, item: &Value| match &item.kind {
        ValueKind::Str(p) => match check_shard_path(base_dir, p, item.span, key) {
            Ok(found) => paths.extend(found),
            Err(e) => c.push(*e),
        },
        _ => c.wrong_type(key, item, "a shard path or pattern string"),
    };
    match &v.kind {
        ValueKind::Str(_) => check(c, v),
        ValueKind::List(items) if items.is_empty() => c.push(SpecError::new(
            "spec::empty-list",
            v.span,
            format!("`{key}` lists no shard"),
            "empty list",
        )),
        ValueKind::List(items) => items.iter().for_each(|item| check(c, item)),
        _ => c.wrong_type(
            key,
            v,
            "a shard path or pattern string (`\"DIR/*train*.bin\"`) or a list of them",
        ),
    }
    paths.into_iter().map(absolute).collect()
}

/// `p` (resolved against the spec's folder) as an absolute path, so that a compiled plan runs
/// from any working directory: the current directory is prepended to a relative `p`; `..`
/// and symbolic links are kept as written. `p` itself when the current directory is unknown.
fn absolute(p: String) -> String {
    std::path::absolute(&p).map_or(p, |a| a.display().to_string())
}

/// `corpus = builtin | "path" | ["path", ...]`; files must exist and be readable, a directory
/// or a glob pattern (`"DIR/*.md"`) stands for the UTF-8 text files it holds (sorted; the
/// others are skipped with a note).
fn corpus(c: &mut Checker, v: &Value, base_dir: &Path) -> CorpusConfig {
    let mut paths = Vec::new();
    let mut check = |c: &mut Checker, item: &Value| match &item.kind {
        ValueKind::Str(p) => match check_corpus_path(base_dir, p, item.span) {
            Ok(found) => {
                paths.extend(found.files);
                c.notes.extend(found.note);
            }
            Err(e) => c.push(*e),
        },
        _ => c.wrong_type("corpus", item, "a file path string"),
    };
    match &v.kind {
        ValueKind::Ident(name) if name == "builtin" => return CorpusConfig::Builtin,
        ValueKind::Ident(name) => c.push(
            unknown_name("corpus", name, v.span, &["builtin"])
                .with_help(format!("use `builtin`, or quote a file path: \"{name}\"")),
        ),
        ValueKind::Str(_) => check(c, v),
        ValueKind::List(items) if items.is_empty() => c.push(SpecError::new(
            "spec::empty-list",
            v.span,
            "`corpus` lists no file",
            "empty list",
        )),
        ValueKind::List(items) => items.iter().for_each(|item| check(c, item)),
        _ => c.wrong_type("corpus", v, "`builtin`, a path string or a list of paths"),
    }
    CorpusConfig::Files {
        paths: paths.into_iter().map(absolute).collect(),
    }
}

/// `train { ... }`.
pub(crate) fn train(c: &mut Checker, b: &Block) -> TrainConfig {
    no_name(c, b);
    let f = c.fields(b, "train", TRAIN_KEYS, &[]);
    let steps = c.uint_req::<u64>(&f, "steps", limits::STEPS);
    let warmup_steps = c.uint_or(&f, "warmup", limits::WARMUP, 0u64);
    if let (Some(s), Some(w)) = (steps, f.get("warmup")) {
        if warmup_steps > s {
            let mut e = SpecError::new(
                "spec::out-of-range",
                w.value.span,
                format!("`warmup` ({warmup_steps}) is longer than `steps` ({s})"),
                "more than steps",
            )
            .with_help(format!(
                "make `warmup` at most {s}, or `steps` at least {warmup_steps}"
            ));
            if let Some(st) = f.get("steps") {
                e = e.with_note(st.value.span, format!("`steps` = {s} here"));
            }
            c.push(e);
        }
    }
    let grad_clip = match f.get("grad_clip") {
        None => Some(1.0),
        Some(e) if e.value.kind == ValueKind::None => None,
        Some(e) => match c.float_value("grad_clip", &e.value, limits::GRAD_CLIP) {
            Some(x) => Some(x),
            None => {
                if let Some(last) = c.errors.last_mut() {
                    last.help = Some("write `grad_clip = none` to disable clipping".into());
                }
                None
            }
        },
    };
    let max_skipped_steps = match f.get("max_skipped_steps") {
        None => Some(limits::DEFAULT_MAX_SKIPPED_STEPS),
        Some(e) if e.value.kind == ValueKind::None => None,
        Some(e) => {
            let n = c.uint_value("max_skipped_steps", &e.value, limits::MAX_SKIPPED_STEPS);
            if n.is_none() {
                if let Some(last) = c.errors.last_mut() {
                    last.help = Some(
                        "write `max_skipped_steps = none` to never stop on skipped steps".into(),
                    );
                }
            }
            n
        }
    };
    // The skip test reads the gradient norm the global-norm clip computes.
    if let (None, Some(n), Some(e)) = (grad_clip, max_skipped_steps, f.get("max_skipped_steps")) {
        if e.value.kind != ValueKind::None {
            c.notes.push(format!(
                "`max_skipped_steps = {n}` has no effect with `grad_clip = none`: a step is \
                 skipped when the clip's gradient norm is not finite, and without a clip no norm \
                 is computed (non-finite gradients then reach the parameters)"
            ));
        }
    }
    TrainConfig {
        steps: steps.unwrap_or(1),
        warmup_steps,
        min_lr_ratio: c.float_or(&f, "min_lr_ratio", limits::MIN_LR_RATIO, 0.1),
        grad_clip,
        eval_interval: c.uint_or(&f, "eval_interval", limits::EVAL_INTERVAL, 0),
        eval_batches: c.uint_or(&f, "eval_batches", limits::EVAL_BATCHES, 4),
        seed: c.uint_or(&f, "seed", limits::SEED, 1337),
        rematerialize: named_option(c, &f, "rematerialize", ir::Rematerialize::NAMES),
        max_skipped_steps,
        refresh_swap: named_option(c, &f, "refresh_swap", ir::RefreshSwap::NAMES),
        grad_accum: c.uint_or(&f, "grad_accum", limits::GRAD_ACCUM, 1),
    }
}

/// Built-in cost-model target descriptions (`passes::cost_model`).
const CALIBRATIONS: &[&str] = &["cpu", "h200", "gh200", "gb10"];

/// `calibration = h200 | "calib.json"`: a built-in target description or the file written by
/// `asteria calibrate` (must exist; resolved against the spec's folder).
fn calibration(c: &mut Checker, v: &Value, base_dir: &Path) -> Option<String> {
    match &v.kind {
        ValueKind::Ident(name) if CALIBRATIONS.contains(&name.as_str()) => Some(name.clone()),
        ValueKind::Ident(name) => {
            c.push(
                unknown_name("calibration", name, v.span, CALIBRATIONS).with_help(format!(
                    "use a built-in target ({}), or quote a calibration file path: \"{name}\"",
                    CALIBRATIONS.join(", ")
                )),
            );
            None
        }
        ValueKind::Str(p) => {
            let path = base_dir.join(p);
            if path.is_file() {
                Some(absolute(path.display().to_string()))
            } else {
                c.push(
                    SpecError::new(
                        "spec::calibration-file",
                        v.span,
                        format!("calibration file not found: `{p}`"),
                        format!("no such file: {}", path.display()),
                    )
                    .with_help("write one with `asteria calibrate -o FILE.json`, or name a built-in target (cpu, h200, gh200, gb10)"),
                );
                None
            }
        }
        _ => {
            c.wrong_type(
                "calibration",
                v,
                "a built-in target name or a calibration file path",
            );
            None
        }
    }
}

/// `target <cpu|cuda> { ... }`.
pub(crate) fn target(c: &mut Checker, b: &Block, base_dir: &Path) -> Option<TargetConfig> {
    let kind = match &b.name {
        None => {
            c.push(missing_name(
                b,
                "target",
                "target cpu { }` or `target cuda { device = 0 }",
            ));
            None
        }
        Some(n) if TARGETS.contains(&n.name.as_str()) => Some(n.name.as_str()),
        Some(n) => {
            c.push(unknown_name("target", &n.name, n.span, TARGETS));
            None
        }
    };
    const CUDA_ONLY: &[(&str, &str)] = &[
        ("device", "`device` applies to `target cuda` only"),
        (
            "gpu_memory",
            "`gpu_memory` applies to `target cuda` only; the CPU engine's budget is `memory`",
        ),
        (
            "rematerialize",
            "`rematerialize` is a key of the `train` block",
        ),
        ("precision", "`precision` applies to `target cuda` only"),
        ("attention", "`attention` applies to `target cuda` only"),
        (
            "weight_casts",
            "`weight_casts` applies to `target cuda` only (the CPU engine computes in fp32)",
        ),
        (
            "refresh_placement",
            "`refresh_placement` applies to `target cuda` only (the CPU engine refreshes on its host pool)",
        ),
    ];
    let (allowed, foreign): (&[&str], &[(&str, &str)]) = match kind {
        Some("cpu") => (
            &[
                "threads",
                "staleness",
                "calibration",
                "eigensolver",
                "memory",
                "host_memory",
                "nvme",
                "nvme_memory",
                "host_updates",
            ],
            CUDA_ONLY,
        ),
        Some("cuda") => (
            &[
                "device",
                "staleness",
                "calibration",
                "precision",
                "eigensolver",
                "attention",
                "refresh_placement",
                "weight_casts",
                "gpu_memory",
                "host_memory",
                "nvme",
                "nvme_memory",
                "host_updates",
            ],
            &[
                ("threads", "`threads` applies to `target cpu` only"),
                (
                    "rematerialize",
                    "`rematerialize` is a key of the `train` block",
                ),
                (
                    "memory",
                    "`memory` is the CPU engine's budget; on `target cuda` it is `gpu_memory`",
                ),
            ],
        ),
        _ => (
            &[
                "threads",
                "device",
                "staleness",
                "calibration",
                "precision",
                "eigensolver",
                "attention",
                "refresh_placement",
                "weight_casts",
                "memory",
                "gpu_memory",
                "host_memory",
                "nvme",
                "nvme_memory",
                "host_updates",
            ],
            &[],
        ),
    };
    let f = c.fields(b, &block_name(b), allowed, foreign);
    let staleness = c.uint_or(&f, "staleness", limits::STALENESS, 0u32);
    let calibration = f
        .get("calibration")
        .and_then(|e| calibration(c, &e.value, base_dir));
    let eigensolver = named_option(c, &f, "eigensolver", ir::Eigensolver::NAMES);
    let budgets = budgets(c, &f, kind == Some("cuda"), base_dir);
    match kind? {
        "cuda" => Some(TargetConfig::Cuda {
            device: c.uint_or(&f, "device", limits::DEVICE, 0),
            staleness,
            calibration,
            precision: match f.get("precision") {
                None => ir::Precision::Bf16,
                Some(e) => {
                    match c.name_value("precision", &e.value, "precision", &["bf16", "fp32"]) {
                        Some("fp32") => ir::Precision::Fp32,
                        _ => ir::Precision::Bf16,
                    }
                }
            },
            eigensolver,
            attention: named_option(c, &f, "attention", ir::AttentionKernel::NAMES),
            refresh_placement: named_option(
                c,
                &f,
                "refresh_placement",
                ir::RefreshPlacement::NAMES,
            ),
            weight_casts: named_option(c, &f, "weight_casts", ir::WeightCasts::NAMES),
            budgets,
        }),
        _ => {
            let threads = match f.get("threads") {
                Some(e) if e.value.kind != ValueKind::None => {
                    c.uint_value("threads", &e.value, limits::THREADS)
                }
                _ => None,
            };
            Some(TargetConfig::Cpu {
                threads,
                staleness,
                calibration,
                eigensolver,
                budgets,
            })
        }
    }
}

/// The memory budgets of a `target` block: `gpu_memory` (cuda) or `memory` (cpu), `host_memory`,
/// `nvme` (a directory, against the spec's folder; checked when the run starts) and
/// `nvme_memory`, sizes with units (`24GiB`); `none` for any of them is no budget.
/// `nvme_memory` needs `nvme`.
fn budgets(c: &mut Checker, f: &Fields, cuda: bool, base_dir: &Path) -> ir::Budgets {
    let device_key = if cuda { "gpu_memory" } else { "memory" };
    // `none` is no budget, as an absent key (so `--set target.gpu_memory=none` removes one).
    let set = |key: &str| f.get(key).filter(|e| e.value.kind != ValueKind::None);
    let device =
        set(device_key).and_then(|e| c.size_value(device_key, &e.value, limits::MEMORY_BUDGET));
    let host = set("host_memory")
        .and_then(|e| c.size_value("host_memory", &e.value, limits::MEMORY_BUDGET));
    let nvme =
        set("nvme_memory").and_then(|e| c.size_value("nvme_memory", &e.value, limits::NVME_BUDGET));
    let nvme_dir = match set("nvme").map(|e| &e.value) {
        None => None,
        Some(v) => match &v.kind {
            // Against the spec's folder, as every path of a spec, and absolute in the plan.
            ValueKind::Str(s) if !s.trim().is_empty() => {
                Some(absolute(base_dir.join(s).display().to_string()))
            }
            _ => {
                c.wrong_type(
                    "nvme",
                    v,
                    "a directory path string (`nvme = \"/mnt/nvme\"`)",
                );
                None
            }
        },
    };
    if let (Some(e), Some(_), None) = (set("nvme_memory"), nvme, set("nvme")) {
        c.push(
            SpecError::new(
                "spec::missing-key",
                e.value.span,
                "`nvme_memory` sizes the NVMe tier, but no `nvme` directory is given",
                "needs `nvme`",
            )
            .with_help("add `nvme = \"/path/to/nvme/dir\"` to the target block"),
        );
    }
    ir::Budgets {
        device,
        host,
        nvme_dir,
        nvme,
        host_updates: named_option(c, f, "host_updates", ir::HostUpdates::NAMES),
    }
}

/// The value of the option key `key` (one of `names`, written as a bare name), or the option's
/// default when the key is absent or wrong (the error is recorded, located).
fn named_option<T: std::str::FromStr + Default>(
    c: &mut Checker,
    f: &Fields,
    key: &str,
    names: &[&'static str],
) -> T {
    f.get(key)
        .and_then(|e| c.name_value(key, &e.value, key, names))
        .and_then(|n| n.parse().ok())
        .unwrap_or_default()
}
