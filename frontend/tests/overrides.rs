//! `--set block.key=value` overrides: applied before checking, checked like spec keys, errors
//! located on the argument.

mod common;

use common::{render, tests_dir, VALID};
use frontend::{check_spec, SpecErrors};
use ir::config::{Config, CorpusConfig, OptimizerConfig, TargetConfig};

fn with(sets: &[&str]) -> Result<Config, SpecErrors> {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    check_spec("test.asteria", VALID, &tests_dir(), &sets).map(|c| c.config)
}

/// `(line, column, message, help)` of each error; line 0 = a `--set` argument.
fn errs(sets: &[&str]) -> Vec<(usize, usize, String, String)> {
    let e = with(sets).expect_err("expected errors");
    e.items()
        .into_iter()
        .zip(e.errors())
        .map(|((l, c, m), err)| (l, c, m, err.help.clone().unwrap_or_default()))
        .collect()
}

#[test]
fn overrides_replace_and_add_keys_in_order() {
    let base = with(&[]).expect("valid");
    assert_eq!(base.train.seed, 1337);
    let c = with(&[
        "train.seed=7",
        "train.steps=25",
        "data.batch_size=4",
        "optimizer.lr=3e-4",
        "optimizer.betas=(0.9, 0.99)",
        "data.corpus=fixtures/hello.txt",
        "train.grad_clip=none",
        "train.steps=30",
    ])
    .expect("valid");
    assert_eq!(c.train.seed, 7);
    assert_eq!(c.train.steps, 30, "a later override wins");
    assert_eq!(c.train.grad_clip, None);
    assert_eq!(c.data.batch_size, 4);
    let OptimizerConfig::Adamw(a) = &c.optimizer else {
        panic!("adamw")
    };
    assert_eq!((a.lr, a.beta1, a.beta2), (3e-4, 0.9, 0.99));
    assert_eq!(
        c.data.corpus,
        CorpusConfig::Files {
            paths: vec![tests_dir().join("fixtures/hello.txt").display().to_string()]
        },
        "an unquoted path is a string, resolved from the spec's folder"
    );
    // Everything else is the spec's.
    assert_eq!(
        (c.model.d_model, c.data.seq_len),
        (base.model.d_model, base.data.seq_len)
    );
    // A missing `target` block is the default `target cpu { }`, then overridden.
    let c = with(&["target.threads=2", "target.staleness=3"]).expect("valid");
    let TargetConfig::Cpu {
        threads, staleness, ..
    } = c.target
    else {
        panic!("cpu")
    };
    assert_eq!((threads, staleness), (Some(2), 3));
}

#[test]
fn an_out_of_range_override_names_the_argument_and_the_range() {
    let e = errs(&["train.seed=7", "train.steps=0"]);
    assert_eq!(e.len(), 1, "{e:#?}");
    let (line, col, msg, _) = &e[0];
    assert_eq!(
        (*line, *col),
        (0, 19),
        "column of `0` in `--set train.steps=0`"
    );
    assert_eq!(
        msg,
        "`--set train.steps=0`: `steps` = 0 is outside the allowed range 1..=1_000_000_000"
    );
    let e = errs(&["optimizer.lr=20"]);
    assert!(
        e[0].2
            .contains("`lr` = 20 is outside the allowed range (0, 10]"),
        "{e:#?}"
    );
    // Cross-block rules see the overridden value.
    let e = errs(&["data.seq_len=128"]);
    assert!(
        e[0].2.starts_with(
            "`--set data.seq_len=128`: `seq_len` (128) exceeds the model's `context` (64)"
        ),
        "{e:#?}"
    );
    // Wrong types, as in a spec.
    let e = errs(&["train.seed=\"7\""]);
    assert!(
        e[0].2
            .contains("expected an integer for `seed`, found a string"),
        "{e:#?}"
    );
    assert!(e[0].3.contains("remove the quotes"), "{e:#?}");
}

#[test]
fn bad_keys_and_blocks_are_located_on_the_argument_with_suggestions() {
    let e = errs(&["train.sed=7"]);
    assert_eq!(e.len(), 1, "{e:#?}");
    assert_eq!((e[0].0, e[0].1), (0, 13));
    assert_eq!(e[0].2, "`--set train.sed=7`: unknown key `sed` in `train`");
    assert!(e[0].3.contains("did you mean `seed`?"), "{e:#?}");

    let e = errs(&["trian.seed=7"]);
    assert_eq!((e[0].0, e[0].1), (0, 7));
    assert!(e[0].2.ends_with("unknown block `trian`"), "{e:#?}");
    assert!(e[0].3.contains("did you mean `train`?"), "{e:#?}");

    for (arg, msg) in [
        ("train.seed", "found no `=`"),
        ("seed=7", "expected `block.key` before `=`"),
        ("train.seed.x=7", "expected `block.key` before `=`"),
        ("train.seed=", "missing value for `train.seed`"),
        ("train.seed=7 8", "unexpected `8` after the value"),
        ("train.seed=1e", "invalid number `1e`"),
    ] {
        let e = errs(&[arg]);
        assert_eq!(e.len(), 1, "{arg}: {e:#?}");
        assert_eq!(e[0].0, 0, "{arg}: on the command line");
        assert!(e[0].2.starts_with(&format!("`--set {arg}`: ")), "{e:#?}");
        assert!(e[0].2.contains(msg), "{arg}: {e:#?}");
    }
    // A spec error and an override error are both reported, the spec's first.
    let src = VALID.replace("  steps = 10\n", "  steps = 10\n  warmup = 100\n");
    let e = check_spec("test.asteria", &src, &tests_dir(), &["train.sed=1".into()])
        .expect_err("errors");
    let items = e.items();
    assert_eq!(items.len(), 2, "{items:#?}");
    assert_eq!((items[0].0, items[1].0), (17, 0), "{items:#?}");
}

#[test]
fn the_report_shows_the_argument_as_the_command_line() {
    let e = with(&["train.seed=7", "train.steps=-3"]).expect_err("errors");
    let out = render(&e);
    assert!(out.contains("[command line:2:"), "{out}");
    assert!(out.contains("--set train.steps=-3"), "{out}");
    assert!(out.contains("negative"), "{out}");
    assert!(
        !out.contains("test.asteria:"),
        "no spec line is shown: {out}"
    );
}

/// An error on a spec key caused by a `--set` of another key names that argument in its hint,
/// not a line of the spec.
#[test]
fn a_spec_error_caused_by_an_override_names_the_argument() {
    let e = errs(&["train.warmup=50", "train.steps=10"]);
    let (line, _, message, help) = &e[0];
    assert_eq!(*line, 0, "the warmup set on the command line: {e:?}");
    assert!(message.contains("longer than `steps` (10)"), "{message}");
    assert!(
        help.contains("`steps` = 10 here: `--set train.steps=10` on the command line"),
        "{help}"
    );
}
