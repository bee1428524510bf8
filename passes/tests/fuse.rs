//! The `fuse` pass's rules one at a time: the egg rewrite `bias-epilogue` on terms (fires, and
//! its alignment condition under bf16 GEMMs), and the whole pass on real specs (fused modules
//! verify, lower to plans that verify, with fewer and smaller buffers). The numerics of the
//! fused ops are tested on the CPU engine (`engine/tests/fused.rs`, `tests/fuse_train.rs`).
use egg::{Extractor, RecExpr, Runner, Symbol};
use passes::fuse::{rules, Dataflow, FuseTarget, KernelCost, RUNNER_LIMITS};
use passes::{PassManager, PassOptions};
use std::collections::HashMap;
use std::sync::Arc;

const CPU: FuseTarget = FuseTarget {
    bf16_gemms: false,
    bf16_attention: false,
};
const BF16: FuseTarget = FuseTarget {
    bf16_gemms: true,
    bf16_attention: true,
};

/// Runs the rules on `term` and returns the cheapest equivalent term, as text.
fn best(term: &str, target: FuseTarget, shapes: &[(&str, (usize, usize))]) -> String {
    let expr: RecExpr<Dataflow> = term.parse().expect("term parses");
    let shapes: HashMap<Symbol, (usize, usize)> =
        shapes.iter().map(|&(n, s)| (Symbol::from(n), s)).collect();
    let rules = rules(target, Arc::new(shapes)).expect("rules build");
    let runner = Runner::default()
        .with_iter_limit(RUNNER_LIMITS.0)
        .with_node_limit(RUNNER_LIMITS.1)
        .with_time_limit(RUNNER_LIMITS.2)
        .with_expr(&expr)
        .run(&rules);
    assert!(
        matches!(runner.stop_reason, Some(egg::StopReason::Saturated)),
        "{:?}",
        runner.stop_reason
    );
    let (_, e) = Extractor::new(&runner.egraph, KernelCost).find_best(runner.roots[0]);
    e.to_string().replace('"', "") // egg quotes symbols with `%`
}

#[test]
fn bias_epilogue_fuses_a_gemm_and_the_bias_add_of_its_product() {
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let term = format!("(bias_add (mat_mul {ta} {tb} %a %b) %bias)");
        assert_eq!(
            best(&term, CPU, &[]),
            format!("(mat_mul_bias {ta} {tb} %a %b %bias)")
        );
    }
    // Nested: only the outer bias_add has a GEMM product; the inner one is a plain value.
    assert_eq!(
        best("(bias_add (bias_add %x %c) %d)", CPU, &[]),
        "(bias_add (bias_add %x %c) %d)"
    );
}

#[test]
fn bias_epilogue_under_bf16_gemms_needs_16_byte_rows() {
    let term = "(bias_add (mat_mul false true %a %b) %bias)";
    // a [N, 64], b [96, 64]: bf16 rows of 128 bytes, f32 output rows of 384 bytes.
    let aligned = [("%a", (16, 64)), ("%b", (96, 64))];
    assert_eq!(
        best(term, BF16, &aligned),
        "(mat_mul_bias false true %a %b %bias)"
    );
    // b with 60 columns: a bf16 row of 120 bytes is not a multiple of 16.
    let odd_k = [("%a", (16, 60)), ("%b", (96, 60))];
    assert_eq!(best(term, BF16, &odd_k), term);
    // Output of 6 columns (b [6, 64] transposed): f32 rows of 24 bytes.
    let odd_out = [("%a", (16, 64)), ("%b", (6, 64))];
    assert_eq!(best(term, BF16, &odd_out), term);
    // Unknown shapes never fuse under bf16; the CPU target ignores alignment.
    assert_eq!(best(term, BF16, &[]), term);
    assert_eq!(
        best(term, CPU, &odd_out),
        "(mat_mul_bias false true %a %b %bias)"
    );
}

/// Like [`best`], with the forward `(attention g %qkv)` in the e-graph, its e-class holding
/// its output `%out` (as the pass builds it).
fn best_with_forward(term: &str, forward: Option<&str>, target: FuseTarget) -> String {
    let mut eg = egg::EGraph::<Dataflow, ()>::default();
    if let Some(f) = forward {
        let fwd = eg.add_expr(&f.parse().expect("forward parses"));
        let out = eg.add(Dataflow::Value(Symbol::from("%out")));
        eg.union(fwd, out);
    }
    let root = eg.add_expr(&term.parse().expect("term parses"));
    eg.rebuild();
    let rules = rules(target, Arc::new(HashMap::new())).expect("rules build");
    let runner = Runner::default()
        .with_iter_limit(RUNNER_LIMITS.0)
        .with_node_limit(RUNNER_LIMITS.1)
        .with_time_limit(RUNNER_LIMITS.2)
        .with_egraph(eg)
        .run(&rules);
    let root = runner.egraph.find(root);
    let (_, e) = Extractor::new(&runner.egraph, KernelCost).find_best(root);
    e.to_string().replace('"', "")
}

#[test]
fn attention_saved_reads_the_forward_of_the_same_qkv_and_geometry() {
    let bwd = "(attention_backward #b2.t4.h2 %dout %qkv)";
    let fwd = "(attention #b2.t4.h2 %qkv)";
    assert_eq!(
        best_with_forward(bwd, Some(fwd), BF16),
        "(attention_backward_saved #b2.t4.h2 %dout %qkv %out)"
    );
    // No forward of that qkv, another geometry, or no bf16 attention: unchanged.
    assert_eq!(best_with_forward(bwd, None, BF16), bwd);
    let other_qkv = "(attention #b2.t4.h2 %qkv2)";
    assert_eq!(best_with_forward(bwd, Some(other_qkv), BF16), bwd);
    let other_geometry = "(attention #b2.t4.h4 %qkv)";
    assert_eq!(best_with_forward(bwd, Some(other_geometry), BF16), bwd);
    assert_eq!(best_with_forward(bwd, Some(fwd), CPU), bwd);
}

fn compile(spec: &str, skip_fuse: bool) -> (ir::Module, schedule::Plan) {
    compile_with(spec, skip_fuse, |_| {})
}

/// [`compile`] with the spec's configuration changed by `edit` first.
fn compile_with(
    spec: &str,
    skip_fuse: bool,
    edit: impl FnOnce(&mut ir::config::Config),
) -> (ir::Module, schedule::Plan) {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(spec);
    let mut config = frontend::load_spec(&path).expect("spec");
    edit(&mut config);
    let mut m = ir::Module::new(config);
    let mut pm = PassManager::new(PassOptions {
        skip: if skip_fuse {
            vec!["fuse".into()]
        } else {
            vec![]
        },
        verify_each: true,
        ..Default::default()
    })
    .expect("pm");
    let (cx, _) = pm
        .run(&mut m, None, &mut std::io::sink())
        .expect("pipeline");
    (m, cx.plan.expect("plan"))
}

fn count(plan: &schedule::Plan, name: &str) -> usize {
    plan.forward
        .iter()
        .chain(&plan.backward)
        .filter(|o| o.name() == name)
        .count()
}

#[test]
fn gpt2_124m_lowers_to_fused_ops_and_bf16_buffers() {
    let (_, plan) = compile("../examples/gpt2-124m.asteria", false);
    let (_, unfused) = compile("../examples/gpt2-124m.asteria", true);
    // 12 blocks × (qkv, attention projection, fc, MLP projection).
    assert_eq!(count(&plan, "mat_mul_bias"), 48);
    assert_eq!(count(&plan, "bias_add"), 0);
    assert_eq!(count(&unfused, "bias_add"), 48);
    assert_eq!(count(&unfused, "mat_mul_bias"), 0);
    // sum-rows-cast: three of each block's four bias gradients come with their activation
    // gradient's bf16 copy, in one op; the c_fc bias sums GELU's bf16 input gradient.
    let sum_rows_casts = count(&plan, "sum_rows_cast");
    assert_eq!(sum_rows_casts, 36);
    assert_eq!(count(&plan, "sum_rows"), 12);
    // 48 products fewer, 12 attention statistics more, one buffer per bf16 copy (cast or
    // sum_rows_cast) more, and the clip factor.
    let casts = count(&plan, "cast");
    assert_eq!(
        plan.buffers.len() + 48 - 12 - casts - sum_rows_casts - 1,
        unfused.buffers.len()
    );
    // clip-into-update: the clip writes its factor and every AdamW reads it.
    let scale = plan.optimizer.iter().find_map(|o| match o {
        schedule::Op::ClipGradNorm { scale, .. } => Some(*scale),
        _ => None,
    });
    let scale = scale.flatten().expect("the clip has a scale output");
    let updates: Vec<_> = plan
        .optimizer
        .iter()
        .filter_map(|o| match o {
            schedule::Op::AdamW { grad_scale, .. } => Some(*grad_scale),
            _ => None,
        })
        .collect();
    assert_eq!(updates.len(), 4 + 12 * 12);
    assert!(updates.iter().all(|g| *g == Some(scale)));
    let cast_outs: Vec<schedule::BufferId> = plan
        .forward
        .iter()
        .chain(&plan.backward)
        .filter_map(|o| match o {
            schedule::Op::Cast { out, .. } => Some(*out),
            schedule::Op::SumRowsCast { out_bf16, .. } => Some(*out_bf16),
            _ => None,
        })
        .collect();
    let bf16: Vec<&str> = plan
        .buffers
        .iter()
        .enumerate()
        .filter(|(i, b)| {
            b.dtype == schedule::DType::Bf16 && !cast_outs.contains(&schedule::BufferId(*i as u32))
        })
        .map(|(_, b)| b.name.as_str())
        .collect();
    // Per block ln_1, ln_2, attn, gelu, qkv (the c_attn GEMM's bias epilogue rounds it: only
    // the tensor-core attention and its backward read it), the attention's output gradient
    // (read only by the attention backward), fc (the c_fc GEMM's output, read only by GELU and
    // its backward), d.gelu (the GEMM's gradient that only GELU's backward reads) and d.fc
    // (read by GEMMs and the c_fc bias gradient's column sums); plus ln_f,
    // the LM head's logits (read by the cross-entropy and its backward, which writes a bf16
    // gradient) and dlogits.
    assert_eq!(bf16.len(), 12 * 9 + 3, "{bf16:?}");
    assert!(bf16.contains(&"d.logits") && bf16.contains(&"h11.gelu") && bf16.contains(&"logits"));
    assert!(bf16.contains(&"h0.qkv") && bf16.contains(&"d.h0.attn"));
    // So no attention keeps a bf16 copy of its qkv of its own.
    assert!(schedule::reserve::saved_attention_qkvs(&plan).is_empty());
    // attention-saved: every backward reads its forward's output and lse.
    let saved = plan
        .backward
        .iter()
        .filter(|o| {
            matches!(
                o,
                schedule::Op::AttentionBackward {
                    fwd_out: Some(_),
                    lse: Some(_),
                    ..
                }
            )
        })
        .count();
    assert_eq!(saved, 12);
    assert!(bf16.contains(&"h3.fc") && bf16.contains(&"d.h3.gelu") && bf16.contains(&"d.h3.fc"));
    assert_gemm_operands_bf16(&plan);
    // bf16-cast (`weight_casts = auto`, no budget: once): the 49 GEMM weights (4 per block and
    // the tied LM head) are cast once, in the forward, and the backward GEMMs read those
    // copies; the 24 qkv and fc biases (their GEMMs write bf16) are cast in the forward.
    let param_casts = |section: &[schedule::Op], rank: usize| {
        section
            .iter()
            .filter(|o| match o {
                schedule::Op::Cast { x, .. } => {
                    let b = plan.buffer(*x);
                    b.class == schedule::BufferClass::Parameter && b.shape.len() == rank
                }
                _ => false,
            })
            .count()
    };
    assert_eq!(param_casts(&plan.forward, 2), 49);
    assert_eq!(param_casts(&plan.backward, 2), 0);
    assert_eq!(param_casts(&plan.forward, 1), 24);
    assert_eq!(param_casts(&plan.backward, 1), 0);
    // The other activation gradients per block that GEMMs read are also summed for a bias
    // gradient: their 36 copies come from sum_rows_cast, none from a cast of their own.
    assert_eq!(casts, 49 + 24, "{casts} casts");
    // Every backward GEMM that reads a weight reads the forward's copy of it.
    let weight_copies: Vec<schedule::BufferId> = plan
        .forward
        .iter()
        .filter_map(|o| match o {
            schedule::Op::Cast { x, out }
                if plan.buffer(*x).class == schedule::BufferClass::Parameter =>
            {
                Some(*out)
            }
            _ => None,
        })
        .collect();
    let backward_weight_reads = plan
        .backward
        .iter()
        .filter(|o| match o {
            schedule::Op::MatMul { a, b, .. } => {
                weight_copies.contains(a) || weight_copies.contains(b)
            }
            _ => false,
        })
        .count();
    // Per block the four dX GEMMs, and the tied LM head's.
    assert_eq!(backward_weight_reads, 49);
    assert!(
        plan.memory.total_bytes() < unfused.memory.total_bytes(),
        "fused {} vs unfused {} bytes",
        plan.memory.total_bytes(),
        unfused.memory.total_bytes()
    );
}

/// `weight_casts`: `twice` casts every GEMM weight again in the backward (the copies live only
/// around their section's GEMMs), and so does `auto` under a `gpu_memory` budget or with
/// rematerialisation; `once` keeps the forward's copies for the backward, which raises the
/// activation arena (2 bytes per weight element at most) and removes 49 casts per step.
#[test]
fn weight_casts_once_or_twice_per_step() {
    let backward_casts = |plan: &schedule::Plan| {
        plan.backward
            .iter()
            .filter(|o| {
                matches!(o, schedule::Op::Cast { x, .. }
                    if plan.buffer(*x).class == schedule::BufferClass::Parameter)
            })
            .count()
    };
    let set = |w: ir::WeightCasts| {
        move |c: &mut ir::config::Config| {
            if let ir::config::TargetConfig::Cuda { weight_casts, .. } = &mut c.target {
                *weight_casts = w;
            }
        }
    };
    let spec = "../examples/gpt2-124m.asteria";
    let (_, once) = compile_with(spec, false, set(ir::WeightCasts::Once));
    let (_, twice) = compile_with(spec, false, set(ir::WeightCasts::Twice));
    assert_eq!(backward_casts(&once), 0);
    assert_eq!(backward_casts(&twice), 49);
    let arena = |p: &schedule::Plan| p.memory.total_bytes();
    assert!(
        arena(&once) > arena(&twice),
        "once {} vs twice {}",
        arena(&once),
        arena(&twice)
    );
    // auto: once without a budget, twice under one or with rematerialisation.
    let (_, auto) = compile(spec, false);
    assert_eq!(backward_casts(&auto), 0);
    let (_, budget) = compile_with(spec, false, |c| {
        if let ir::config::TargetConfig::Cuda { budgets, .. } = &mut c.target {
            budgets.device = Some(120 << 30);
        }
    });
    assert_eq!(backward_casts(&budget), 49);
    let (_, remat) = compile_with(spec, false, |c| {
        c.train.rematerialize = ir::Rematerialize::Selective;
    });
    assert_eq!(backward_casts(&remat), 49);
}

/// Every GEMM of the forward and backward reads two bf16 plan buffers.
fn assert_gemm_operands_bf16(plan: &schedule::Plan) {
    for o in plan.forward.iter().chain(&plan.backward) {
        if let schedule::Op::MatMul { a, b, .. } | schedule::Op::MatMulBias { a, b, .. } = o {
            for id in [a, b] {
                assert_eq!(
                    plan.buffer(*id).dtype,
                    schedule::DType::Bf16,
                    "{} reads f32 `{}`",
                    o.name(),
                    plan.buffer(*id).name
                );
            }
        }
    }
}

/// LLaMA on the GPU in bf16: RMSNorm and SwiGLU outputs that only GEMMs read and the fc GEMM's
/// output that only SwiGLU reads are written in bf16, every GEMM operand is bf16, and the
/// casts are step-local buffers of the memory plan.
#[test]
fn llama_under_bf16_writes_norm_and_swiglu_outputs_in_bf16() {
    let dir = std::env::temp_dir().join(format!("asteria-fuse-llama-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let src = std::fs::read_to_string(
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../examples/tiny-llama-soap.asteria"),
    )
    .expect("example");
    let spec = dir.join("llama-bf16.asteria");
    std::fs::write(
        &spec,
        src.replace("target cpu { }", "target cuda {\n  precision = bf16\n}"),
    )
    .expect("write spec");
    let (_, plan) = compile(spec.to_str().expect("utf-8 path"), false);
    std::fs::remove_dir_all(&dir).ok();
    assert_gemm_operands_bf16(&plan);
    let bf16_of = |op: &str| {
        plan.forward
            .iter()
            .filter(|o| o.name() == op)
            .filter(|o| {
                o.operands()
                    .iter()
                    .any(|&(n, id)| n == "out" && plan.buffer(id).dtype == schedule::DType::Bf16)
            })
            .count()
    };
    // 2 blocks × 2 norms + the final norm; 2 SwiGLUs.
    assert_eq!(bf16_of("rms_norm"), 5);
    assert_eq!(bf16_of("swi_glu"), 2);
    // The fc GEMMs' outputs, read only by SwiGLU's forward and backward, and the LM head's
    // logits are written in bf16.
    assert_eq!(bf16_of("mat_mul"), 3);
    assert!(plan
        .buffers
        .iter()
        .filter(|b| b.name.starts_with('h') && b.name.ends_with(".fc"))
        .all(|b| b.dtype == schedule::DType::Bf16));
    let res = plan.residency();
    for o in plan.forward.iter().chain(&plan.backward) {
        if let schedule::Op::Cast { out, .. } = o {
            assert!(
                res[out.index()].live_range().is_some(),
                "casts are step-local"
            );
        }
    }
}

#[test]
fn cpu_specs_fuse_bias_epilogues_only() {
    let (m, plan) = compile("../examples/tiny.asteria", false);
    assert_eq!(count(&plan, "mat_mul_bias"), 8);
    assert!(plan
        .buffers
        .iter()
        .all(|b| b.dtype != schedule::DType::Bf16));
    assert!(!m.to_string().contains("bias_add"));
    // No clip-into-update off the GPU: the clip scales in place, the updates read the grads.
    assert!(plan.optimizer.iter().all(|o| !matches!(
        o,
        schedule::Op::ClipGradNorm { scale: Some(_), .. }
            | schedule::Op::AdamW {
                grad_scale: Some(_),
                ..
            }
    )));
    // LLaMA has no biases: nothing to fuse in the model, and the CPU target makes nothing
    // bf16; only SOAP's composed steps become `soap_update` (`soap-update`, every target).
    let (_, llama) = compile("../examples/tiny-llama-soap.asteria", false);
    let (_, llama_unfused) = compile("../examples/tiny-llama-soap.asteria", true);
    assert_eq!(llama.forward, llama_unfused.forward);
    assert_eq!(llama.backward, llama_unfused.backward);
    let ops =
        |p: &schedule::Plan, name: &str| p.optimizer.iter().filter(|o| o.name() == name).count();
    assert_eq!(ops(&llama, "soap_update"), 15);
    assert_eq!(ops(&llama_unfused, "soap_update"), 0);
    assert_eq!(ops(&llama_unfused, "elementwise_update"), 30);
    assert_eq!(
        ops(&llama, "project") + ops(&llama, "elementwise_update"),
        0
    );
}

#[test]
fn only_optional_passes_can_be_skipped() {
    for name in ["expand-model", "lower", "nope"] {
        let err = PassManager::new(PassOptions {
            skip: vec![name.into()],
            ..Default::default()
        });
        assert!(err.is_err(), "skipping `{name}` must be refused");
    }
}

/// `--skip-rule` / `--apply-rule`: only the composed steps' instruction selections, an
/// `--apply-rule` only for a rule some target leaves out, never both for one rule.
#[test]
fn only_instruction_selection_rules_can_be_skipped_or_applied() {
    let pm = |skip: &[&str], apply: &[&str]| {
        PassManager::new(PassOptions {
            skip_rules: skip.iter().map(|s| s.to_string()).collect(),
            apply_rules: apply.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        })
    };
    assert!(pm(&["soap-update", "shampoo-update", "kl-shampoo-update"], &[]).is_ok());
    assert!(pm(&[], &["soap-update"]).is_ok());
    for (skip, apply) in [
        (&["bias-epilogue"][..], &[][..]),
        (&["soap"][..], &[][..]),
        (&[][..], &["shampoo-update"][..]),
        (&["soap-update"][..], &["soap-update"][..]),
    ] {
        assert!(
            pm(skip, apply).is_err(),
            "skip {skip:?} apply {apply:?} must be refused"
        );
    }
}

/// A CUDA target leaves SOAP's step composed (the composed step measured faster on the H200);
/// `--apply-rule soap-update` selects `soap_update`, and the fuse report says which it was.
#[test]
fn soap_update_is_off_by_default_on_cuda_targets() {
    let spec = std::path::Path::new("../bench/specs/gpt2-124m-soap.asteria");
    let text = std::fs::read_to_string(spec).expect("spec");
    let text = text.replace("corpus = \"../data/medium\"", "corpus = builtin");
    assert!(text.contains("corpus = builtin"));
    let path =
        std::env::temp_dir().join(format!("asteria-fuse-soap-{}.asteria", std::process::id()));
    std::fs::write(&path, text).expect("write");
    let run = |apply: bool| {
        let config = frontend::load_spec(&path).expect("spec loads");
        let mut m = ir::Module::new(config);
        let mut pm = PassManager::new(PassOptions {
            apply_rules: if apply {
                vec!["soap-update".into()]
            } else {
                vec![]
            },
            print_after: vec!["fuse".into()],
            ..Default::default()
        })
        .expect("pass manager");
        let mut out = Vec::new();
        let (cx, _) = pm.run(&mut m, None, &mut out).expect("pipeline");
        (
            cx.plan.expect("plan"),
            String::from_utf8(out).expect("utf8"),
        )
    };
    let count =
        |p: &schedule::Plan, name: &str| p.optimizer.iter().filter(|o| o.name() == name).count();
    let (composed, report) = run(false);
    assert_eq!(count(&composed, "soap_update"), 0);
    assert!(count(&composed, "project") > 0);
    assert!(
        report.contains("; soap-update: not applied: on a CUDA target"),
        "{report}"
    );
    let (fused, report) = run(true);
    let _ = std::fs::remove_file(&path);
    assert_eq!(count(&fused, "project"), 0);
    assert!(count(&fused, "soap_update") > 0);
    assert!(
        report.contains("; soap-update: applied (--apply-rule)"),
        "{report}"
    );
}

/// On a CUDA target every second-order step may stay composed (`--skip-rule`): the engine runs
/// Shampoo's `shampoo_factor_update`, `shampoo_precondition` and `graft`, and KL-Shampoo's
/// `kl_scale` and `kl_factor_update`, around `project` and the generated rule kernels.
#[test]
fn composed_shampoo_and_kl_shampoo_compile_for_cuda() {
    let compile = |example: &str, rule: &str| {
        let path = std::path::Path::new("../examples").join(example);
        let text = std::fs::read_to_string(&path).expect("example");
        let text = text.replace("target cpu {", "target cuda {");
        assert!(text.contains("target cuda {"), "{example}");
        let config = frontend::parse_spec(example, &text, std::path::Path::new("../examples"))
            .expect("spec");
        let mut m = ir::Module::new(config);
        let mut pm = PassManager::new(PassOptions {
            skip_rules: vec![rule.into()],
            ..Default::default()
        })
        .expect("pass manager");
        let (cx, _) = pm
            .run(&mut m, None, &mut std::io::sink())
            .expect("pipeline");
        cx.plan.expect("plan")
    };
    let has = |plan: &schedule::Plan, op: &str| plan.optimizer.iter().any(|o| o.name() == op);
    let plan = compile("tiny-shampoo.asteria", "shampoo-update");
    for op in ["shampoo_factor_update", "shampoo_precondition", "graft"] {
        assert!(has(&plan, op), "{op}");
    }
    assert!(!has(&plan, "shampoo_update"));
    let plan = compile("tiny-kl-shampoo.asteria", "kl-shampoo-update");
    for op in ["kl_scale", "kl_factor_update", "project"] {
        assert!(has(&plan, op), "{op}");
    }
    assert!(!has(&plan, "kl_shampoo_update"));
}

/// The MFU numerator counts PaLM's model FLOPs on the fused bf16 plan: `6·N` per token for the
/// N GEMM weights (the blocks' four matrices and the tied LM head) plus `12·L·C·T` per token
/// for attention — casts, bias epilogues and the saved attention statistics add nothing.
#[test]
fn model_flops_per_step_are_palms_6n_plus_attention() {
    let (_, plan) = compile("../examples/gpt2-124m.asteria", false);
    let (l, c, t, v, batch) = (12.0, 768.0, 1024.0, 50304.0, 16.0);
    let n = l * (c * 3.0 * c + c * c + 2.0 * c * 4.0 * c) + v * c;
    let tokens = batch * t;
    let want = 6.0 * n * tokens + 12.0 * l * c * t * tokens;
    let got = plan.model_flops_per_step();
    assert!(
        ((got - want) / want).abs() < 1e-12,
        "got {got:e}, want {want:e}"
    );
}
