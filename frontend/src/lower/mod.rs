//! The per-block rules: which keys each block takes, their types, ranges and defaults, the
//! checks across blocks (`seq_len ≤ context`, tokenizer vs `vocab`), and the resulting
//! `ir::config::Config`. Defaults follow nanoGPT for AdamW and the reference `soap.py` for SOAP.
//! One file per block family: [`model`], [`optimizer`], [`run`] (data, train, target).

mod model;
mod optimizer;
mod run;

use std::collections::{HashMap, HashSet};
use std::path::Path;

use ir::config::{Config, DataConfig, ModelConfig, TargetConfig, TokenizerKind};
use ir::limits;

use crate::ast::{Block, Entry, Span, Spec, ValueKind};
use crate::check::{Checker, Fields};
use crate::diagnostics::{did_you_mean, list, suggest, SpecError};

/// The block keywords.
pub(crate) const BLOCKS: &[&str] = &["model", "optimizer", "data", "train", "target"];
const REQUIRED_BLOCKS: &[(&str, &str)] = &[
    ("model", "model gpt2 { vocab = 50257 ... }"),
    ("optimizer", "optimizer adamw { lr = 6e-4 }"),
    ("data", "data { batch_size = 16  seq_len = 1024 }"),
    ("train", "train { steps = 1000 }"),
];
/// Tokenizer names (`data { tokenizer = ... }`).
pub(crate) const TOKENIZERS: &[&str] = &["gpt2", "bytes"];
/// GPT-2 BPE (`r50k_base`) vocabulary size.
const GPT2_VOCAB: usize = 50257;

/// Checks `spec` and builds the run configuration named `run_name`; `None` when `c` collected
/// any error. Corpus paths are resolved against `base_dir`.
pub fn lower(spec: &Spec, run_name: &str, base_dir: &Path, c: &mut Checker) -> Option<Config> {
    let mut by_kind: HashMap<&str, &Block> = HashMap::new();
    let mut suggested = HashSet::new();
    for b in &spec.blocks {
        let kind = b.kind.name.as_str();
        if !BLOCKS.contains(&kind) {
            if let Some(s) = suggest(kind, BLOCKS) {
                suggested.insert(s);
            }
            c.push(
                SpecError::new(
                    "spec::unknown-block",
                    b.kind.span,
                    format!("unknown block `{kind}`"),
                    "unknown block",
                )
                .with_help(did_you_mean(kind, BLOCKS)),
            );
        } else if let Some(first) = by_kind.get(kind) {
            c.push(
                SpecError::new(
                    "spec::duplicate-block",
                    b.kind.span,
                    format!("duplicate `{kind}` block"),
                    "second block",
                )
                .with_note(first.kind.span, "first defined here")
                .with_help("a spec has at most one block of each kind"),
            );
        } else {
            by_kind.insert(kind, b);
        }
    }
    let missing: Vec<&(&str, &str)> = REQUIRED_BLOCKS
        .iter()
        .filter(|(kind, _)| !by_kind.contains_key(kind) && !suggested.contains(kind))
        .collect();
    if !missing.is_empty() {
        let names: Vec<&str> = missing.iter().map(|(k, _)| *k).collect();
        let examples: Vec<String> = missing.iter().map(|(_, e)| format!("`{e}`")).collect();
        let plural = if names.len() == 1 { "" } else { "s" };
        c.push(
            SpecError::new(
                "spec::missing-block",
                Span::new(0, 0),
                format!("missing {} block{plural}", list(&names)),
                "in this spec",
            )
            .with_help(format!("add {}", examples.join(", "))),
        );
    }
    let model = by_kind.get("model").map(|b| model::model(c, b));
    let optimizer = by_kind.get("optimizer").map(|b| optimizer::optimizer(c, b));
    let data = by_kind.get("data").map(|b| run::data(c, b, base_dir));
    let train = by_kind.get("train").map(|b| run::train(c, b));
    let target = match by_kind.get("target") {
        Some(b) => run::target(c, b, base_dir),
        None => Some(TargetConfig::Cpu {
            threads: None,
            staleness: 0,
            calibration: None,
            eigensolver: ir::Eigensolver::default(),
            budgets: Default::default(),
        }),
    };
    if let (Some((m, mf)), Some((d, df))) = (&model, &data) {
        cross_check(c, m, mf, d, df);
    }
    if !c.errors.is_empty() {
        return None;
    }
    Some(Config {
        name: run_name.to_string(),
        model: model?.0,
        optimizer: optimizer??,
        data: data?.0,
        train: train?,
        target: target?,
    })
}

/// Checks across blocks: `seq_len ≤ context`, tokenizer vs `vocab` (text corpora).
fn cross_check(c: &mut Checker, m: &ModelConfig, mf: &Fields, d: &DataConfig, df: &Fields) {
    // Only keys that were read without error: the config holds defaults for the others.
    let valid = |e: &Entry, range: limits::IntRange| matches!(e.value.kind, ValueKind::Int(n) if range.contains(n));
    if let (Some(s), Some(ctx)) = (df.get("seq_len"), mf.get("context")) {
        if valid(s, limits::SEQ_LEN) && valid(ctx, limits::CONTEXT) && d.seq_len > m.context {
            c.push(
                SpecError::new(
                    "spec::seq-len-exceeds-context",
                    s.value.span,
                    format!(
                        "`seq_len` ({}) exceeds the model's `context` ({})",
                        d.seq_len, m.context
                    ),
                    "longer than the context",
                )
                .with_note(ctx.value.span, "context set here"),
            );
        }
    }
    let Some(v) = mf.get("vocab").filter(|v| valid(v, limits::VOCAB)) else {
        return;
    };
    // Shards carry their own token ids: the engine checks each against `vocab` when it loads
    // them (the largest id, not the tokenizer's size, is what must fit).
    if matches!(d.corpus, ir::config::CorpusConfig::Shards { .. }) {
        return;
    }
    if let Some(t) = df.get("tokenizer") {
        if !matches!(&t.value.kind, ValueKind::Ident(n) if TOKENIZERS.contains(&n.as_str())) {
            return;
        }
    }
    let (ok, msg, help) = match d.tokenizer {
        TokenizerKind::Bytes => (
            m.vocab_size == 256,
            format!(
                "the bytes tokenizer needs `vocab = 256`, found {}",
                m.vocab_size
            ),
            "set `vocab = 256`".to_string(),
        ),
        TokenizerKind::Gpt2 => (
            m.vocab_size >= GPT2_VOCAB,
            format!(
                "the gpt2 tokenizer has {GPT2_VOCAB} tokens but `vocab` is {}",
                m.vocab_size
            ),
            format!("set `vocab = {GPT2_VOCAB}` (or more, e.g. 50304), or use `tokenizer = bytes`"),
        ),
    };
    if !ok {
        let mut e = SpecError::new(
            "spec::vocab-mismatch",
            v.value.span,
            msg,
            "does not fit the tokenizer",
        )
        .with_help(help);
        if let Some(t) = df.get("tokenizer") {
            e = e.with_note(t.value.span, "tokenizer chosen here");
        }
        c.push(e);
    }
}

/// `model gpt2` / `data`: how the block is named in messages.
pub(crate) fn block_name(b: &Block) -> String {
    match &b.name {
        Some(n) => format!("{} {}", b.kind.name, n.name),
        None => b.kind.name.clone(),
    }
}

pub(crate) fn missing_name(b: &Block, what: &str, example: &str) -> SpecError {
    SpecError::new(
        "spec::missing-name",
        b.kind.span,
        format!("missing {what} after `{}`", b.kind.name),
        format!("expected a {what} name after this"),
    )
    .with_help(format!("write `{example}`"))
}

/// `data` and `train` take no name.
pub(crate) fn no_name(c: &mut Checker, b: &Block) {
    if let Some(n) = &b.name {
        c.push(
            SpecError::new(
                "spec::unexpected-name",
                n.span,
                format!("the `{}` block takes no name", b.kind.name),
                "unexpected name",
            )
            .with_help(format!("write `{} {{ ... }}`", b.kind.name)),
        );
    }
}
