//! Semantic errors: each test breaks one thing in an otherwise valid spec and checks the exact
//! line:column, a fragment of the message, and the hint where there is one.

mod common;

use common::{assert_error, edit, errors, VALID};

#[test]
fn unknown_block_suggests() {
    let src = edit("train {", "trian {");
    assert_error(
        &src,
        15,
        1,
        "unknown block `trian`",
        Some("did you mean `train`?"),
    );
}

#[test]
fn unknown_key_suggests() {
    let src = edit("  lr = 1e-3\n", "  lr = 1e-3\n  weight_decy = 0.1\n");
    assert_error(
        &src,
        10,
        3,
        "unknown key `weight_decy` in `optimizer adamw`",
        Some("did you mean `weight_decay`?"),
    );
}

#[test]
fn unknown_key_alias_from_nanogpt() {
    let src = edit("  layers = 2", "  n_layer = 2");
    let errs = errors(&src);
    assert_eq!(errs.len(), 2, "{errs:#?}");
    // The missing key points at the block header, the unknown one at itself.
    assert_eq!((errs[0].0, errs[0].1), (1, 1));
    assert!(errs[0].2.contains("missing required key `layers`"));
    assert_eq!((errs[1].0, errs[1].1), (5, 3));
    assert_eq!(errs[1].3.as_deref(), Some("did you mean `layers`?"));
}

#[test]
fn duplicate_key() {
    let src = edit("  layers = 2\n", "  layers = 2\n  layers = 3\n");
    assert_error(
        &src,
        6,
        3,
        "duplicate key `layers` in `model gpt2`",
        Some("remove one"),
    );
}

#[test]
fn missing_required_key_points_at_header() {
    let src = edit("  heads = 4\n", "");
    assert_error(
        &src,
        1,
        1,
        "missing required key `heads` in `model gpt2`",
        Some("add `heads = 12`"),
    );
}

#[test]
fn string_where_integer_expected() {
    let src = edit("batch_size = 8", "batch_size = \"8\"");
    assert_error(
        &src,
        12,
        16,
        "expected an integer for `batch_size`, found a string",
        Some("remove the quotes: `8`"),
    );
}

#[test]
fn float_where_integer_expected() {
    let src = edit("steps = 10", "steps = 1e3");
    assert_error(
        &src,
        16,
        11,
        "expected an integer for `steps`, found a float",
        Some("`1000`"),
    );
}

#[test]
fn name_where_number_expected() {
    let src = edit("lr = 1e-3", "lr = fast");
    assert_error(
        &src,
        9,
        8,
        "expected a number for `lr`, found the name `fast`",
        None,
    );
}

#[test]
fn beta_outside_unit_interval() {
    let src = edit("lr = 1e-3", "lr = 1e-3  betas = (0.9, 1.0)");
    assert_error(
        &src,
        9,
        28,
        "beta2 (the second of `betas`) = 1 is outside the allowed range [0, 1)",
        None,
    );
}

#[test]
fn betas_not_a_pair() {
    let src = edit("lr = 1e-3", "lr = 1e-3  betas = (0.9, 0.95, 0.99)");
    assert_error(
        &src,
        9,
        22,
        "`betas` must be a pair `(beta1, beta2)`, found a tuple of 3",
        None,
    );
    let src = edit("lr = 1e-3", "lr = 1e-3  betas = [0.9, 0.95]");
    assert_error(&src, 9, 22, "found a list", Some("use parentheses"));
}

#[test]
fn lr_not_positive() {
    let src = edit("lr = 1e-3", "lr = 0.0");
    assert_error(
        &src,
        9,
        8,
        "`lr` = 0 is outside the allowed range (0, 10]",
        None,
    );
}

#[test]
fn negative_integer() {
    let src = edit("batch_size = 8", "batch_size = -8");
    assert_error(
        &src,
        12,
        16,
        "`batch_size` = -8 is outside the allowed range 1..=65_536",
        None,
    );
}

#[test]
fn val_fraction_out_of_range() {
    let src = edit("  seq_len = 64\n", "  seq_len = 64\n  val_fraction = 1.0\n");
    assert_error(
        &src,
        14,
        18,
        "`val_fraction` = 1 is outside the allowed range (0, 1)",
        None,
    );
}

#[test]
fn seq_len_exceeds_context() {
    let src = edit("seq_len = 64", "seq_len = 128");
    assert_error(
        &src,
        13,
        13,
        "`seq_len` (128) exceeds the model's `context` (64)",
        None,
    );
}

#[test]
fn heads_must_divide_d_model() {
    let src = edit("heads = 4", "heads = 5");
    assert_error(
        &src,
        6,
        11,
        "`heads` (5) does not divide `d_model` (64)",
        Some("1, 2, 4, 8, 16, 32, 64"),
    );
}

#[test]
fn llama_head_size_must_be_even() {
    let src = edit("model gpt2 {", "model llama {").replace("heads = 4", "heads = 64");
    assert_error(
        &src,
        6,
        11,
        "head size d_model / heads = 1 must be even for RoPE",
        None,
    );
}

#[test]
fn zero_layers_and_zero_steps() {
    let src = edit("layers = 2", "layers = 0");
    assert_error(
        &src,
        5,
        12,
        "`layers` = 0 is outside the allowed range 1..=1024",
        None,
    );
    let src = edit("steps = 10", "steps = 0");
    assert_error(
        &src,
        16,
        11,
        "`steps` = 0 is outside the allowed range 1..=1_000_000_000",
        None,
    );
}

#[test]
fn unknown_model_family() {
    let src = edit("model gpt2", "model gtp2");
    assert_error(
        &src,
        1,
        7,
        "unknown model family `gtp2`",
        Some("did you mean `gpt2`?"),
    );
}

#[test]
fn missing_model_family() {
    let src = edit("model gpt2", "model");
    assert_error(
        &src,
        1,
        1,
        "missing model family after `model`",
        Some("`model gpt2 { ... }`"),
    );
}

#[test]
fn unknown_optimizer() {
    let src = edit("optimizer adamw", "optimizer adam");
    assert_error(
        &src,
        8,
        11,
        "unknown optimizer `adam`",
        Some("did you mean `adamw`?"),
    );
    let src = edit("optimizer adamw", "optimizer adafactor");
    assert_error(
        &src,
        8,
        11,
        "unknown optimizer `adafactor`",
        Some("supported: `adamw`, `soap`, `kl_shampoo`, `shampoo`, `lion`"),
    );
    let src = edit("optimizer adamw", "optimizer loin");
    assert_error(
        &src,
        8,
        11,
        "unknown optimizer `loin`",
        Some("did you mean `lion`?"),
    );
}

/// A rule-defined optimizer's block is checked against its definition: unknown keys with
/// suggestions, ranges, and its pair keys.
#[test]
fn rule_defined_optimizer_keys_are_checked() {
    let src = edit(
        "optimizer adamw {\n  lr = 1e-3",
        "optimizer lion {\n  lr = 1e-3\n  weight_decy = 1",
    );
    assert_error(
        &src,
        10,
        3,
        "unknown key `weight_decy` in `optimizer lion`",
        Some("did you mean `weight_decay`?"),
    );
    let src = edit(
        "optimizer adamw {\n  lr = 1e-3",
        "optimizer lion {\n  lr = 20",
    );
    let (line, col, msg, _) = common::one_error(&src);
    assert_eq!((line, col), (9, 8), "{msg}");
    assert!(msg.contains("lr") && msg.contains("(0, 10]"), "{msg}");
    let src = edit(
        "optimizer adamw {\n  lr = 1e-3",
        "optimizer lion {\n  betas = (0.9, 1.5)",
    );
    let (line, _, msg, _) = common::one_error(&src);
    assert_eq!(line, 9, "{msg}");
    assert!(msg.contains("beta2 (the second of `betas`)"), "{msg}");
    let src = edit(
        "optimizer adamw {\n  lr = 1e-3",
        "optimizer lion {\n  betas = [0.9, 0.99]",
    );
    let (_, _, msg, help) = common::one_error(&src);
    assert!(
        msg.contains("`betas` must be a pair `(beta1, beta2)`"),
        "{msg}"
    );
    assert_eq!(
        help.as_deref(),
        Some("use parentheses: `betas = (0.9, 0.99)`")
    );
}

#[test]
fn unknown_tokenizer() {
    let src = edit("  seq_len = 64\n", "  seq_len = 64\n  tokenizer = gtp2\n");
    assert_error(
        &src,
        14,
        15,
        "unknown tokenizer `gtp2`",
        Some("did you mean `gpt2`?"),
    );
}

#[test]
fn quoted_tokenizer_name() {
    let src = edit(
        "  seq_len = 64\n",
        "  seq_len = 64\n  tokenizer = \"bytes\"\n",
    );
    assert_error(
        &src,
        14,
        15,
        "expected a tokenizer name for `tokenizer`, found a string",
        Some("without quotes: `bytes`"),
    );
}

#[test]
fn unknown_target() {
    let src = format!("{VALID}target cdua {{ }}\n");
    assert_error(
        &src,
        18,
        8,
        "unknown target `cdua`",
        Some("did you mean `cuda`?"),
    );
}

#[test]
fn rope_theta_not_valid_for_gpt2() {
    let src = edit("  heads = 4\n", "  heads = 4\n  rope_theta = 10000\n");
    assert_error(
        &src,
        7,
        3,
        "`rope_theta` is not valid for `model gpt2`",
        Some("`model llama` only"),
    );
}

#[test]
fn soap_option_on_adamw() {
    let src = edit("lr = 1e-3", "lr = 1e-3  precondition_frequency = 10");
    assert_error(
        &src,
        9,
        14,
        "`precondition_frequency` is not valid for `optimizer adamw`",
        Some("`optimizer soap` only"),
    );
}

#[test]
fn threads_on_cuda_target() {
    let src = format!("{VALID}target cuda {{\n  threads = 4\n}}\n");
    assert_error(
        &src,
        19,
        3,
        "`threads` is not valid for `target cuda`",
        Some("`target cpu` only"),
    );
}

#[test]
fn unknown_attention_kernel_lists_the_allowed_ones() {
    let src = format!("{VALID}target cuda {{\n  attention = flash\n}}\n");
    assert_error(
        &src,
        19,
        15,
        "unknown attention `flash`",
        Some("supported: `auto`, `fused`, `gemm`"),
    );
}

#[test]
fn refresh_placement_on_cpu_target() {
    let src = format!("{VALID}target cpu {{\n  refresh_placement = gpu\n}}\n");
    assert_error(
        &src,
        19,
        3,
        "`refresh_placement` is not valid for `target cpu`",
        Some("`target cuda` only"),
    );
}

#[test]
fn misspelt_eigensolver_suggests() {
    let src = format!("{VALID}target cpu {{\n  eigensolver = lapak\n}}\n");
    assert_error(
        &src,
        19,
        17,
        "unknown eigensolver `lapak`",
        Some("did you mean `lapack`?"),
    );
}

#[test]
fn missing_corpus_file_points_at_path() {
    let src = edit(
        "  seq_len = 64\n",
        "  seq_len = 64\n  corpus = [\"fixtures/hello.txt\", \"no-such.txt\"]\n",
    );
    assert_error(
        &src,
        14,
        35,
        "corpus file not found: `no-such.txt`",
        Some("relative paths are resolved from the spec file's folder"),
    );
}

#[test]
fn corpus_directory_without_text_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("blob.bin"), [7u8, 0, 1, 2]).expect("write");
    std::fs::write(dir.path().join("latin1.txt"), b"caf\xe9\n").expect("write");
    let p = dir.path().display().to_string();
    let src = edit(
        "  seq_len = 64\n",
        &format!("  seq_len = 64\n  corpus = \"{p}\"\n"),
    );
    assert_error(
        &src,
        14,
        12,
        &format!("corpus directory `{p}` holds no UTF-8 text file"),
        Some("blob.bin (a NUL byte at offset 1)"),
    );
    assert_error(
        &src,
        14,
        12,
        "holds no UTF-8 text file",
        Some("latin1.txt (invalid UTF-8 at offset 3)"),
    );
    // An empty directory says so too.
    let empty = tempfile::tempdir().expect("tempdir");
    let p = empty.path().display().to_string();
    let src = edit(
        "  seq_len = 64\n",
        &format!("  seq_len = 64\n  corpus = \"{p}\"\n"),
    );
    assert_error(&src, 14, 12, "holds no UTF-8 text file", None);
}

#[test]
fn bytes_tokenizer_needs_vocab_256() {
    let src = edit("  seq_len = 64\n", "  seq_len = 64\n  tokenizer = bytes\n");
    assert_error(
        &src,
        2,
        11,
        "the bytes tokenizer needs `vocab = 256`, found 50257",
        Some("`vocab = 256`"),
    );
}

#[test]
fn gpt2_tokenizer_needs_full_vocab() {
    let src = edit("vocab = 50257", "vocab = 1_000");
    assert_error(
        &src,
        2,
        11,
        "the gpt2 tokenizer has 50257 tokens but `vocab` is 1000",
        Some("50304"),
    );
}

#[test]
fn missing_blocks() {
    let src = VALID.replace("train {\n  steps = 10\n}\n", "");
    assert_error(
        &src,
        1,
        1,
        "missing `train` block",
        Some("`train { steps = 1000 }`"),
    );
    let src = &VALID[..VALID.find("data {").expect("data block")];
    assert_error(src, 1, 1, "missing `data`, `train` blocks", None);
}

#[test]
fn duplicate_block() {
    let src = format!("{VALID}train {{ steps = 5 }}\n");
    assert_error(&src, 18, 1, "duplicate `train` block", None);
}

#[test]
fn name_on_data_block() {
    let src = edit("data {", "data moby {");
    assert_error(
        &src,
        11,
        6,
        "the `data` block takes no name",
        Some("write `data { ... }`"),
    );
}

#[test]
fn warmup_longer_than_steps() {
    let src = edit("steps = 10", "steps = 10  warmup = 20");
    assert_error(
        &src,
        16,
        24,
        "`warmup` (20) is longer than `steps` (10)",
        None,
    );
}

#[test]
fn grad_clip_zero_suggests_none() {
    let src = edit("steps = 10", "steps = 10  grad_clip = 0");
    assert_error(
        &src,
        16,
        27,
        "`grad_clip` = 0 is outside the allowed range (0, 1e6]",
        Some("`grad_clip = none`"),
    );
}

#[test]
fn max_skipped_steps_zero_is_out_of_range_and_suggests_none() {
    let src = edit("steps = 10", "steps = 10  max_skipped_steps = 0");
    assert_error(
        &src,
        16,
        35,
        "`max_skipped_steps` = 0 is outside the allowed range 1..=1_000_000_000",
        Some("`max_skipped_steps = none`"),
    );
    let src = edit("steps = 10", "steps = 10  max_skipped_steps = 2.5");
    let errs = errors(&src);
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert_eq!((errs[0].0, errs[0].1), (16, 35));
}

#[test]
fn max_skipped_steps_defaults_to_10_and_none_never_stops() {
    let parse = |src: &str| common::parse(src).expect("valid").train.max_skipped_steps;
    assert_eq!(parse(common::VALID), Some(10));
    assert_eq!(
        parse(&edit("steps = 10", "steps = 10  max_skipped_steps = 3")),
        Some(3)
    );
    assert_eq!(
        parse(&edit("steps = 10", "steps = 10  max_skipped_steps = none")),
        None
    );
}

#[test]
fn refresh_swap_defaults_to_finished_and_a_typo_lists_the_allowed_ones() {
    let parse = |src: &str| common::parse(src).expect("valid").train.refresh_swap;
    assert_eq!(parse(VALID), ir::RefreshSwap::Finished);
    assert_eq!(
        parse(&edit("steps = 10", "steps = 10  refresh_swap = deadline")),
        ir::RefreshSwap::Deadline
    );
    let src = edit("steps = 10", "steps = 10  refresh_swap = deadlien");
    assert_error(
        &src,
        16,
        30,
        "unknown refresh_swap `deadlien`",
        Some("did you mean `deadline`?"),
    );
}

#[test]
fn grad_accum_out_of_range_is_located() {
    let src = edit("steps = 10", "steps = 10  grad_accum = 0");
    assert_error(
        &src,
        16,
        28,
        "`grad_accum` = 0 is outside the allowed range 1..=65_536",
        None,
    );
    let src = edit("steps = 10", "steps = 10  grad_accum = 100000");
    let errs = errors(&src);
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert_eq!((errs[0].0, errs[0].1), (16, 28));
}
