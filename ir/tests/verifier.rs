//! Verifier negative tests: each broken module is rejected with an error that names the
//! offending instruction (`inst<n> (%result = op)`) or value (`%name`).
mod common;

use common::B;
use ir::{parse_module, BufferClass, Init, Module, Op, Section, TensorType, VerifierError};

fn errors(m: &Module) -> Vec<VerifierError> {
    m.verify().expect_err("the module should not verify")
}

/// Exactly one error, whose text mentions every `needle`.
fn one(m: &Module, needles: &[&str]) -> VerifierError {
    let errs = errors(m);
    assert_eq!(errs.len(), 1, "{}", m.display_with_errors(&errs));
    let text = errs[0].to_string();
    for n in needles {
        assert!(text.contains(n), "{text:?} does not mention {n:?}");
    }
    errs.into_iter().next().unwrap()
}

fn fwd() -> B {
    common::tiny_forward()
}

#[test]
fn wrong_result_shape() {
    let text = common::tiny()
        .to_string()
        .replace("%qkv: f32[8, 48] = mat_mul", "%qkv: f32[8, 47] = mat_mul");
    let m = parse_module(&text).unwrap();
    let errs = errors(&m);
    let e = &errs[0];
    assert!(
        e.to_string()
            .contains("(%qkv = mat_mul): operand `out` (%qkv: f32[8, 47]) must have shape [8, 48]"),
        "{e}"
    );
    assert!(matches!(e, VerifierError::Operand { operand: "out", value, .. } if value == "%qkv"));
    // The consumer of %qkv is flagged too (its result no longer matches its input).
    assert!(
        errs[1].to_string().contains("(%qkv.rope = rope)"),
        "{errs:?}"
    );
}

#[test]
fn matmul_inner_dimension() {
    let mut b = fwd();
    let id =
        b.m.insts()
            .find(|&i| {
                b.m.inst(i)
                    .results
                    .first()
                    .is_some_and(|&r| b.m.value(r).name == "proj")
            })
            .unwrap();
    *b.m.op_mut(id) = Op::MatMul {
        trans_a: true,
        trans_b: true,
    };
    let e = one(
        &b.m,
        &[
            "(%proj = mat_mul)",
            "operand `b` (%proj.w: f32[16, 16])",
            "inner dimension 16 does not match a's 8",
        ],
    );
    assert_eq!(e.inst(), Some(id));
}

#[test]
fn attention_heads_must_divide_width() {
    let mut b = fwd();
    let id =
        b.m.insts()
            .find(|&i| matches!(b.m.inst(i).op, Op::Attention { .. }))
            .unwrap();
    *b.m.op_mut(id) = Op::Attention {
        batch: 2,
        seq_len: 4,
        n_heads: 3,
    };
    one(
        &b.m,
        &[
            "(%att = attention)",
            "operand `qkv` (%qkv.rope: f32[8, 48])",
            "n_heads 3",
        ],
    );
}

#[test]
fn wrong_argument_count() {
    let mut b = fwd();
    let (x, h) = (b.v("x"), b.v("h"));
    b.f(Section::Forward, Op::Gelu, &[x, h], "bad", &[8, 16]);
    let e = one(&b.m, &["(%bad = gelu)", "expects 1 arguments, found 2"]);
    assert!(matches!(e, VerifierError::ArgCount { found: 2, .. }));
}

#[test]
fn layer_norm_takes_two_or_three_arguments() {
    let mut b = fwd();
    let (x, w) = (b.v("x"), b.v("ln.w"));
    b.f(
        Section::Forward,
        Op::LayerNorm { eps: 1e-5 },
        &[x, w, w, w],
        "bad",
        &[8, 16],
    );
    one(
        &b.m,
        &[
            "(%bad = layer_norm)",
            "expects 2 (x, weight) or 3 (x, weight, bias) arguments, found 4",
        ],
    );
}

#[test]
fn soap_update_left_right_flags_set_the_arity() {
    let mut m = common::tiny();
    let id = m
        .insts()
        .find(|&i| {
            matches!(
                m.inst(i).op,
                Op::SoapUpdate {
                    left: true,
                    right: false,
                    ..
                }
            )
        })
        .unwrap();
    let Op::SoapUpdate { hyper, .. } = m.inst(id).op.clone() else {
        unreachable!()
    };
    *m.op_mut(id) = Op::SoapUpdate {
        hyper,
        left: true,
        right: true,
    };
    let e = one(
        &m,
        &[
            "(soap_update)",
            "expects 6 (given `left` / `right`) arguments, found 5",
        ],
    );
    assert_eq!(e.inst(), Some(id));
    assert!(e.to_string().starts_with(&format!("{id} (soap_update)")));
}

#[test]
fn layer_norm_backward_bias_flag_sets_the_result_count() {
    let mut m = common::tiny();
    let id = m
        .insts()
        .find(|&i| matches!(m.inst(i).op, Op::LayerNormBackward { bias: true, .. }))
        .unwrap();
    *m.op_mut(id) = Op::LayerNormBackward {
        eps: 1e-5,
        bias: false,
    };
    one(
        &m,
        &[
            "(%d.x, %grad.ln.w, %grad.ln.b = layer_norm_backward)",
            "expects 2 results, found 3",
        ],
    );
}

#[test]
fn use_before_def_in_the_layout() {
    let mut b = fwd();
    // `%early` takes the next index; `%late` the one after.
    let later = Module::value_id_from_index(b.m.num_values() + 1);
    b.f(Section::Forward, Op::Gelu, &[later], "early", &[8, 16]);
    b.f(Section::Forward, Op::Gelu, &[b.v("x")], "late", &[8, 16]);
    let e = one(
        &b.m,
        &[
            "(%early = gelu)",
            "%late is used before its definition by inst",
        ],
    );
    assert!(matches!(e, VerifierError::UseBeforeDef { ref value, .. } if value == "%late"));
}

#[test]
fn forward_cannot_use_a_backward_value() {
    let mut b = fwd();
    let d = b.f(Section::Backward, Op::Gelu, &[b.v("x")], "d.x", &[8, 16]);
    b.f(Section::Forward, Op::Gelu, &[d], "uses.backward", &[8, 16]);
    one(
        &b.m,
        &[
            "(%uses.backward = gelu)",
            "%d.x is used before its definition",
        ],
    );
}

#[test]
fn dangling_value() {
    let mut b = fwd();
    let ghost = Module::value_id_from_index(10_000);
    b.f(Section::Forward, Op::Gelu, &[ghost], "g", &[8, 16]);
    let e = one(
        &b.m,
        &[
            "(%g = gelu)",
            "argument 0",
            "is not defined by any instruction",
        ],
    );
    assert!(matches!(e, VerifierError::Undefined { index: 0, .. }));
}

#[test]
fn wrong_dtype() {
    let mut b = fwd();
    let (wte, x) = (b.v("wte"), b.v("h"));
    let bad_ids = b.f(Section::Forward, Op::SumRows, &[x], "float.ids", &[16]);
    b.f(
        Section::Forward,
        Op::Embedding,
        &[wte, bad_ids],
        "emb",
        &[16, 16],
    );
    let e = one(
        &b.m,
        &[
            "(%emb = embedding)",
            "operand `ids` (%float.ids: f32[16]) must be i32",
        ],
    );
    assert!(matches!(e, VerifierError::Operand { operand: "ids", .. }));
    let mut b = fwd();
    let tokens = b.v("tokens");
    b.f(Section::Forward, Op::Gelu, &[tokens], "gelu.ids", &[8]);
    one(
        &b.m,
        &[
            "(%gelu.ids = gelu)",
            "operand `x` (%tokens: i32[8]) must be f32",
        ],
    );
}

#[test]
fn in_place_op_in_forward() {
    let mut b = fwd();
    let wpe = b.v("wpe");
    let m = b.state("wpe.m", BufferClass::ExpAvg, Init::Zeros, &[8, 16]);
    let v = b.state("wpe.v", BufferClass::ExpAvgSq, Init::Zeros, &[8, 16]);
    let x = b.v("x");
    let op = Op::AdamW {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let id = b.m.push0(Section::Forward, op, &[wpe, x, m, v]);
    let errs = errors(&b.m);
    let e = errs
        .iter()
        .find(|e| matches!(e, VerifierError::Section { .. }))
        .expect("a section error");
    assert_eq!(e.inst(), Some(id));
    assert!(
        e.to_string()
            .contains("`adam_w` is not allowed in the forward section"),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("in-place optimizer ops belong in the optimizer section"),
        "{e}"
    );
    // ... and its grad operand is not the parameter's gradient.
    assert!(errs
        .iter()
        .any(|e| e.to_string().contains("operand `grad` (%x: f32[8, 16])")));
}

#[test]
fn state_only_in_the_state_section() {
    let mut b = fwd();
    b.m.push1(
        Section::Forward,
        Op::State {
            class: BufferClass::Parameter,
            init: Init::Zeros,
        },
        &[],
        "late.param",
        TensorType::f32([4]),
    );
    b.f(
        Section::State,
        Op::Gelu,
        &[b.v("wte")],
        "gelu.in.state",
        &[32, 16],
    );
    let errs = errors(&b.m);
    assert_eq!(errs.len(), 2, "{errs:?}");
    assert!(errs[0]
        .to_string()
        .contains("(%gelu.in.state = gelu): `gelu` is not allowed in the state section"));
    assert!(errs[1]
        .to_string()
        .contains("(%late.param = state): `state` is not allowed in the forward section"));
}

#[test]
fn missing_loss() {
    let mut b = fwd();
    let loss_marker = b.m.insts().find(|&i| b.m.inst(i).op == Op::Loss).unwrap();
    *b.m.op_mut(loss_marker) = Op::Gelu; // now a gelu without results
    let errs = errors(&b.m);
    assert!(errs.iter().any(|e| *e
        == VerifierError::Module {
            problem: "no `loss` marker (exactly one is required)".into()
        }));
    let text = b.m.display_with_errors(&errs);
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[3].starts_with("; error: module: no `loss` marker"),
        "{text}"
    );
}

#[test]
fn two_losses() {
    let mut b = fwd();
    let loss = b.v("loss");
    let second = b.m.push0(Section::Forward, Op::Loss, &[loss]);
    let e = one(&b.m, &["(loss)", "more than one `loss` marker"]);
    assert_eq!(e.inst(), Some(second));
}

#[test]
fn loss_must_be_scalar_and_forward() {
    let mut b = fwd();
    let x = b.v("x");
    b.m.push0(Section::Forward, Op::Loss, &[x]);
    let errs = errors(&b.m);
    assert!(
        errs.iter().any(|e| e
            .to_string()
            .contains("operand `loss` (%x: f32[8, 16]) must have shape [1]")),
        "{errs:?}"
    );
}

#[test]
fn grad_of_shape_mismatch() {
    let mut m = common::tiny();
    let text = m
        .to_string()
        .replace("grad_of %wpe, %grad.wpe", "grad_of %wpe, %grad.proj.w");
    m = parse_module(&text).unwrap();
    let errs = errors(&m);
    let e = errs
        .iter()
        .find(|e| matches!(e, VerifierError::Operand { .. }))
        .unwrap();
    assert!(e.to_string().contains("(grad_of): operand `grad` (%grad.proj.w: f32[16, 16]) must have the shape of `param` [8, 16]"), "{e}");
    // The optimizer ops of %wpe now refer to a gradient that is not the marked one.
    assert!(
        errs.iter().any(|e| e
            .to_string()
            .contains("must be the gradient of %wpe (%grad.proj.w)")),
        "{errs:?}"
    );
}

#[test]
fn grad_of_needs_a_parameter() {
    let mut b = fwd();
    let (x, h) = (b.v("x"), b.v("h"));
    b.m.push0(Section::Backward, Op::GradOf, &[x, h]);
    one(
        &b.m,
        &[
            "(grad_of)",
            "operand `param` (%x: f32[8, 16]) must be a `state parameter` buffer",
        ],
    );
}

#[test]
fn grad_of_in_the_forward_section() {
    let mut b = fwd();
    let (w, x) = (b.v("ln.w"), b.v("r"));
    let g = b.f(Section::Forward, Op::SumRows, &[x], "g", &[16]);
    b.m.push0(Section::Forward, Op::GradOf, &[w, g]);
    one(&b.m, &["(grad_of): `grad_of` is not allowed in the forward section (gradient markers belong in the backward section)"]);
}

#[test]
fn swapped_moments_are_caught_by_class() {
    let text = common::tiny().to_string().replace(
        "adam_w %wpe, %grad.wpe, %wpe.exp_avg, %wpe.exp_avg_sq",
        "adam_w %wpe, %grad.wpe, %wpe.exp_avg_sq, %wpe.exp_avg",
    );
    let m = parse_module(&text).unwrap();
    one(
        &m,
        &[
            "(adam_w)",
            "operand `exp_avg` (%wpe.exp_avg_sq: f32[8, 16]) must be a `state exp_avg` buffer",
        ],
    );
}

#[test]
fn eigenbasis_refresh_side() {
    let text = common::tiny().to_string().replacen(
        "{side = 1, frequency = 10,",
        "{side = 2, frequency = 10,",
        1,
    );
    let m = parse_module(&text).unwrap();
    one(&m, &["(eigenbasis_refresh)", "side must be 0 or 1"]);
}

#[test]
fn eigenbasis_refresh_offset_below_frequency() {
    let text = common::tiny()
        .to_string()
        .replacen("offset = 1,", "offset = 10,", 1);
    let m = parse_module(&text).unwrap();
    one(&m, &["(eigenbasis_refresh)", "offset below it"]);
}

#[test]
fn input_shape_follows_the_config() {
    let text = common::tiny()
        .to_string()
        .replace("%targets: i32[8]", "%targets: i32[9]");
    let m = parse_module(&text).unwrap();
    let errs = errors(&m);
    assert!(
        errs[0]
            .to_string()
            .contains("(%targets = input): operand `value` (%targets: i32[9]) must have shape [8]"),
        "{errs:?}"
    );
}

#[test]
fn zero_sized_value() {
    let mut b = fwd();
    b.state("empty", BufferClass::Scalar, Init::Zeros, &[0]);
    let e = one(&b.m, &["%empty: has an empty or zero-sized shape f32[0]"]);
    assert!(matches!(e, VerifierError::Value { ref value, .. } if value == "%empty"));
}

#[test]
fn clip_grad_norm_takes_gradients() {
    let text = common::tiny().to_string().replace(
        "clip_grad_norm %grad.ln.w {max_norm = none}",
        "clip_grad_norm %x {max_norm = -1.0}",
    );
    let m = parse_module(&text).unwrap();
    one(
        &m,
        &[
            "(%grad_norm.ln = clip_grad_norm)",
            "max_norm must be positive, got -1.0",
        ],
    );
    let text = common::tiny().to_string().replace(
        "clip_grad_norm %grad.ln.w {max_norm = none}",
        "clip_grad_norm %x {max_norm = none}",
    );
    let m = parse_module(&text).unwrap();
    one(
        &m,
        &[
            "(%grad_norm.ln = clip_grad_norm)",
            "operand `grads` (%x: f32[8, 16]) must be a gradient marked by `grad_of`",
        ],
    );
}

#[test]
fn all_errors_are_reported_in_program_order() {
    let text = common::tiny()
        .to_string()
        .replace("%qkv: f32[8, 48] = mat_mul", "%qkv: f32[8, 47] = mat_mul")
        .replacen("{side = 1, frequency = 10,", "{side = 1, frequency = 0,", 1);
    let m = parse_module(&text).unwrap();
    let errs = errors(&m);
    assert_eq!(errs.len(), 3, "{errs:?}");
    assert!(errs[0].to_string().contains("%qkv = mat_mul"));
    assert!(errs[1].to_string().contains("%qkv.rope = rope"));
    assert!(errs[2].to_string().contains("eigenbasis_refresh"));
    let annotated = m.display_with_errors(&errs);
    assert_eq!(annotated.matches("; error: ").count(), 3);
}

/// The composed SOAP step's ops (`project`, `elementwise_update` with a result): a projection
/// rotates at least one side and reads a gradient or an update's result; an update of a value
/// derived from a gradient is of that gradient's parameter; a rule's result must be written by
/// it.
#[test]
fn composed_optimizer_ops_are_checked() {
    let find = |m: &Module, f: &dyn Fn(&Op) -> bool| m.insts().find(|&i| f(&m.inst(i).op)).unwrap();
    let fwd_project = |o: &Op| matches!(o, Op::Project { back: false, .. });
    // No side: arity and attribute.
    let mut m = common::tiny();
    let id = find(&m, &fwd_project);
    let args = m.inst(id).args[..1].to_vec();
    m.replace_inst(
        id,
        Op::Project {
            back: false,
            left: false,
            right: false,
        },
        &args,
    );
    let e = one(&m, &["= project)", "rotates at least one side"]);
    assert_eq!(e.inst(), Some(id));
    // A parameter is not a gradient.
    let mut m = common::tiny();
    let id = find(&m, &fwd_project);
    let mut args = m.inst(id).args.clone();
    args[0] = m
        .value_by_name("qkv.w")
        .expect("the composed step's parameter");
    let op = m.inst(id).op.clone();
    m.replace_inst(id, op, &args);
    // ... and the two updates that read values rotated from it are then not computed from
    // their parameter's gradient either.
    let errs = errors(&m);
    let texts: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
    assert_eq!(texts.len(), 3, "{texts:?}");
    assert!(texts[0].contains("= project)") && texts[0].contains("must be a gradient"));
    for t in &texts[1..] {
        assert!(t.contains("elementwise_update") && t.contains("not from the gradient"));
    }
    // A result the rule never writes.
    let mut m = common::tiny();
    let id = find(
        &m,
        &|o| matches!(o, Op::ElementwiseUpdate { rule } if !rule.results.is_empty()),
    );
    if let Op::ElementwiseUpdate { rule } = m.op_mut(id) {
        rule.outputs.pop();
        rule.expr = "(list (select_lt 0.5 warm g m) (* g g))".into();
    }
    one(&m, &["elementwise_update", "result `u` is never written"]);
}

/// The composed Shampoo step's matrix ops (`shampoo_factor_update`, `shampoo_precondition`,
/// `graft`): one operand per block side of the right shape and class, and block sizes ≥ 1.
#[test]
fn composed_shampoo_ops_are_checked() {
    let find = |m: &Module, name: &str| {
        m.insts()
            .find(|&i| m.inst(i).op.name() == name)
            .expect("the composed Shampoo step")
    };
    // A factor missing: `wpe` [8, 16] in blocks of 8 has four block sides.
    let mut m = common::tiny();
    let id = find(&m, "shampoo_factor_update");
    let mut args = m.inst(id).args.clone();
    args.pop();
    let op = m.inst(id).op.clone();
    m.replace_inst(id, op, &args);
    let e = one(
        &m,
        &[
            "shampoo_factor_update",
            "has 4 block sides, got 3 `factor` operands",
        ],
    );
    assert_eq!(e.inst(), Some(id));
    // A Kronecker factor where an inverse root belongs.
    let mut m = common::tiny();
    let id = find(&m, "shampoo_precondition");
    let mut args = m.inst(id).args.clone();
    args[1] = m.value_by_name("wpe.F0").expect("a factor");
    let op = m.inst(id).op.clone();
    m.replace_inst(id, op, &args);
    one(
        &m,
        &[
            "shampoo_precondition",
            "must be a `state inverse_root` buffer",
        ],
    );
    // Blocks of 0.
    let mut m = common::tiny();
    let id = find(&m, "graft");
    let args = m.inst(id).args.clone();
    m.replace_inst(
        id,
        Op::Graft {
            max_preconditioner_dim: 0,
        },
        &args,
    );
    one(&m, &["graft", "max_preconditioner_dim must be at least 1"]);
    // Grafting onto a tensor of another shape.
    let mut m = common::tiny();
    let id = find(&m, "graft");
    let mut args = m.inst(id).args.clone();
    args[1] = m.value_by_name("ln.b").expect("a 1-D parameter");
    let op = m.inst(id).op.clone();
    m.replace_inst(id, op, &args);
    let texts: Vec<String> = errors(&m).iter().map(|e| e.to_string()).collect();
    assert!(
        texts
            .iter()
            .any(|t| t.contains("graft") && t.contains("shape")),
        "{texts:?}"
    );
}

/// The composed KL-Shampoo step's ops (`kl_scale`, `kl_factor_update`): estimates of the sides'
/// lengths and of their class, factors and bases per side.
#[test]
fn composed_kl_shampoo_ops_are_checked() {
    let find = |m: &Module, name: &str| {
        m.insts()
            .find(|&i| m.inst(i).op.name() == name)
            .expect("the composed KL-Shampoo step")
    };
    // A Kronecker factor where an eigenvalue estimate belongs.
    let mut m = common::tiny();
    let id = find(&m, "kl_scale");
    let mut args = m.inst(id).args.clone();
    args[1] = m.value_by_name("proj.w.SL").expect("a factor");
    let op = m.inst(id).op.clone();
    m.replace_inst(id, op, &args);
    let texts: Vec<String> = errors(&m).iter().map(|e| e.to_string()).collect();
    assert!(
        texts
            .iter()
            .any(|t| t.contains("kl_scale") && t.contains("eig_left")),
        "{texts:?}"
    );
    // A side without its basis: the arity given `left` / `right`.
    let mut m = common::tiny();
    let id = find(&m, "kl_factor_update");
    let mut args = m.inst(id).args.clone();
    args.pop();
    let op = m.inst(id).op.clone();
    m.replace_inst(id, op, &args);
    one(&m, &["kl_factor_update", "(given `left` / `right`)"]);
    // shampoo_beta out of range.
    let mut m = common::tiny();
    let id = find(&m, "kl_factor_update");
    let args = m.inst(id).args.clone();
    let op = Op::KlFactorUpdate {
        shampoo_beta: 1.5,
        init_factor: 0.1,
        max_clamp_value: 4000.0,
        left: true,
        right: true,
    };
    m.replace_inst(id, op, &args);
    one(&m, &["kl_factor_update", "shampoo_beta must be in [0, 1)"]);
}

/// `graft` scales a step by the norm of an Adam step of the same gradient: an operand computed
/// from anything else is refused.
#[test]
fn graft_operands_come_from_one_gradient() {
    let mut m = common::tiny();
    let id = m
        .insts()
        .find(|&i| m.inst(i).op.name() == "graft")
        .expect("the composed Shampoo step");
    let mut args = m.inst(id).args.clone();
    args[1] = m.value_by_name("wpe").expect("the parameter");
    let op = m.inst(id).op.clone();
    m.replace_inst(id, op, &args);
    let texts: Vec<String> = errors(&m).iter().map(|e| e.to_string()).collect();
    assert!(
        texts.iter().any(
            |t| t.contains("graft") && t.contains("not from the gradient `x` is computed from")
        ),
        "{texts:?}"
    );
}
