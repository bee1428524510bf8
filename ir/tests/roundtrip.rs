//! Print → parse → print is the identity, and the hand-built module that uses every op variant
//! verifies.
mod common;

use ir::{parse_module, Op, Section};

#[test]
fn tiny_module_verifies() {
    let m = common::tiny();
    if let Err(errors) = m.verify() {
        panic!("{}", m.display_with_errors(&errors));
    }
}

#[test]
fn forward_only_module_verifies() {
    let m = common::tiny_forward().m;
    assert_eq!(m.verify(), Ok(()));
}

#[test]
fn covers_every_op_variant() {
    let m = common::tiny();
    let mut names: Vec<&str> = m.insts().map(|i| m.inst(i).op.name()).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), 40, "{names:?}");
    let has = |f: &dyn Fn(&Op) -> bool| m.insts().any(|i| f(&m.inst(i).op));
    assert!(has(&|o| matches!(
        o,
        Op::LayerNormBackward { bias: true, .. }
    )));
    assert!(has(&|o| matches!(
        o,
        Op::LayerNormBackward { bias: false, .. }
    )));
    assert!(has(&|o| *o == Op::ClipGradNorm { max_norm: None }));
    for (l, r) in [(false, false), (true, false), (false, true), (true, true)] {
        assert!(has(
            &|o| matches!(o, Op::SoapUpdate { left, right, .. } if (*left, *right) == (l, r))
        ));
        assert!(has(
            &|o| matches!(o, Op::SoapFactorUpdate { left, right, .. } if (*left, *right) == (l, r))
        ));
        assert!(has(&|o| *o
            == Op::MatMul {
                trans_a: l,
                trans_b: r
            }));
    }
    assert!(m
        .insts()
        .any(|i| m.inst(i).op.name() == "layer_norm" && m.inst(i).args.len() == 2));
    assert!(m
        .insts()
        .any(|i| m.inst(i).op.name() == "layer_norm" && m.inst(i).args.len() == 3));
}

#[test]
fn print_parse_print_is_identity() {
    let m = common::tiny();
    let text = m.to_string();
    let parsed = parse_module(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(parsed.to_string(), text);
    assert_eq!(parsed.config, m.config);
    assert_eq!(parsed.verify(), Ok(()));
    // Same instructions, section by section, with the same names and types.
    for s in Section::ALL {
        let a: Vec<_> = m.section(s).collect();
        let b: Vec<_> = parsed.section(s).collect();
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            let (x, y) = (m.inst(*x), parsed.inst(*y));
            assert_eq!(x.op, y.op);
            let names = |m: &ir::Module, v: &[ir::ValueId]| {
                v.iter()
                    .map(|&v| m.value(v).clone().name)
                    .collect::<Vec<_>>()
            };
            assert_eq!(names(&m, &x.args), names(&parsed, &y.args));
            assert_eq!(names(&m, &x.results), names(&parsed, &y.results));
            for (&a, &b) in x.results.iter().zip(&y.results) {
                assert_eq!(m.value(a).ty, parsed.value(b).ty);
            }
        }
    }
}

#[test]
fn printed_form() {
    let text = common::tiny().to_string();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("; asteria IR"));
    assert_eq!(lines.next(), Some("module tiny"));
    assert!(lines
        .next()
        .is_some_and(|l| l.starts_with(r#"config {"name":"tiny","model":{"family":"gpt2""#)));
    assert_eq!(lines.next(), Some("state:"));
    for expected in [
        "  %wte: f32[32, 16] = state parameter normal(std = 0.02)",
        "  %ln.w: f32[16] = state parameter ones",
        "  %tokens: i32[8] = input tokens",
        "forward:",
        "  %x0: f32[8, 16] = embedding %wte, %tokens",
        "  %h: f32[8, 16] = layer_norm %x, %ln.w, %ln.b {eps = 1e-5}",
        "  %qkv: f32[8, 48] = mat_mul %h, %qkv.w {trans_a = false, trans_b = true}",
        "  %qkv.rope: f32[8, 48] = rope %qkv {seq_len = 4, head_dim = 8, rotated_cols = 32, theta = 10000.0}",
        "  loss %loss",
        "backward:",
        "  %d.x: f32[8, 16], %grad.ln.w: f32[16], %grad.ln.b: f32[16] = layer_norm_backward %d.res3, %x, %ln.w {eps = 1e-5, bias = true}",
        "  grad_of %wte, %grad.wte",
        "optimizer:",
        "  %grad_norm.ln: f32[1] = clip_grad_norm %grad.ln.w {max_norm = none}",
        "  adam_w %wpe, %grad.wpe, %wpe.exp_avg, %wpe.exp_avg_sq {lr = 0.0006, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1}",
        "  soap_update %wte, %grad.wte, %wte.exp_avg, %wte.exp_avg_sq, %wte.QL {lr = 0.003, beta1 = 0.95, beta2 = 0.95, eps = 1e-8, weight_decay = 0.01, correct_bias = true, normalize_grads = false, left = true, right = false}",
        "  soap_factor_update %grad.ln.w {shampoo_beta = 0.95, left = false, right = false}",
        "refresh:",
        "  eigenbasis_refresh %qkv.w.R, %qkv.w.QR, %qkv.w.exp_avg, %qkv.w.exp_avg_sq {side = 1, frequency = 10, offset = 1, staleness = 2, placement = gpu_side, method = soap}",
    ] {
        assert!(text.lines().any(|l| l == expected), "missing line {expected:?} in\n{text}");
    }
}

#[test]
fn floats_round_trip_bit_exactly() {
    let mut m = common::tiny();
    let awkward = [
        0.1 + 0.2,
        1.0 / 3.0,
        f64::MIN_POSITIVE,
        5e-324,
        1e300,
        -0.0,
        f64::INFINITY,
    ];
    let ids: Vec<_> = m
        .insts()
        .filter(|&i| matches!(m.inst(i).op, Op::LayerNorm { .. }))
        .collect();
    for (&id, &x) in ids.iter().cycle().zip(&awkward) {
        *m.op_mut(id) = Op::LayerNorm { eps: x };
        let parsed = parse_module(&m.to_string()).unwrap();
        let back = parsed
            .insts()
            .find(|&i| matches!(parsed.inst(i).op, Op::LayerNorm { .. }))
            .unwrap();
        let first = m
            .insts()
            .find(|&i| matches!(m.inst(i).op, Op::LayerNorm { .. }))
            .unwrap();
        match (&parsed.inst(back).op, &m.inst(first).op) {
            (Op::LayerNorm { eps: a }, Op::LayerNorm { eps: b }) => {
                assert_eq!(a.to_bits(), b.to_bits())
            }
            _ => unreachable!(),
        }
        assert_eq!(parsed.to_string(), m.to_string());
    }
}

#[test]
fn interleaved_layout_prints_by_section_and_still_verifies() {
    // Passes push `state` buffers after backward ops (expand-optimizer does); execution order
    // is by section, so this is well-formed and prints grouped.
    let m = common::tiny();
    let layout: Vec<Section> = m.insts().map(|i| m.inst(i).section).collect();
    assert!(
        layout.windows(2).any(|w| w[0] > w[1]),
        "the fixture interleaves sections"
    );
    let text = m.to_string();
    let reparsed = parse_module(&text).unwrap();
    let layout: Vec<Section> = reparsed.insts().map(|i| reparsed.inst(i).section).collect();
    assert!(layout.windows(2).all(|w| w[0] <= w[1]));
}

#[test]
fn comments_blank_lines_and_spacing_are_ignored() {
    let text = common::tiny().to_string();
    let noisy: String = text
        .lines()
        .map(|l| {
            let l = if l.starts_with("config") {
                l.to_string()
            } else {
                l.replace(", ", " ,\t").replace(" = ", "=")
            };
            format!("  {l}   ; trailing comment\n\n")
        })
        .collect();
    let parsed = parse_module(&noisy).unwrap_or_else(|e| panic!("{e}\n{noisy}"));
    assert_eq!(parsed.to_string(), text);
}

#[test]
fn display_with_errors_annotates_the_instruction() {
    let mut m = common::tiny();
    let att = m
        .insts()
        .find(|&i| matches!(m.inst(i).op, Op::Attention { .. }))
        .unwrap();
    *m.op_mut(att) = Op::Attention {
        batch: 2,
        seq_len: 4,
        n_heads: 5,
    };
    let errors = m.verify().unwrap_err();
    let text = m.display_with_errors(&errors);
    let lines: Vec<&str> = text.lines().collect();
    let i = lines
        .iter()
        .position(|l| l.contains("= attention %qkv.rope"))
        .unwrap();
    assert!(
        lines[i + 1].starts_with("  ; error: inst"),
        "{}",
        lines[i + 1]
    );
    assert!(
        lines[i + 1].contains("(%att = attention)") && lines[i + 1].contains("n_heads 5"),
        "{}",
        lines[i + 1]
    );
    // The annotated text is still valid input.
    assert_eq!(parse_module(&text).unwrap().to_string(), m.to_string());
}

#[test]
fn quoted_module_name() {
    let mut m = common::tiny_forward().m;
    m.config.name = "my run; v2".into();
    let text = m.to_string();
    assert!(text.contains("module \"my run; v2\"\n"));
    assert_eq!(parse_module(&text).unwrap().to_string(), text);
}

#[test]
fn config_floats_round_trip_bit_exactly() {
    let mut m = common::tiny_forward().m;
    for x in [
        0.1 + 0.2,
        1.0 / 3.0,
        2.0f64.sqrt() * 1e-7,
        0.1 * 3.0,
        123456.789e-12,
    ] {
        m.config.model.init_std = x;
        m.config.model.norm_eps = x / 7.0;
        m.config.data.val_fraction = x / 3.0;
        let parsed = parse_module(&m.to_string()).unwrap();
        assert_eq!(parsed.config.model.init_std.to_bits(), x.to_bits());
        assert_eq!(parsed.config, m.config);
    }
}
