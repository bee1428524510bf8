//! A small GPT-2 compiled with and without the `fuse` pass (`PassOptions::skip`) and trained a
//! few steps on the CPU engine on one fixed batch, AdamW, SOAP, Shampoo and KL-Shampoo:
//! - CPU target: only bias epilogues apply; `mat_mul_bias` is computed bit-identically to the
//!   pair, so every loss is identical, bit for bit.
//! - CUDA target with `precision = fp32`: bias epilogues and `clip-into-update` (a clip
//!   factor the updates read) are bit-identical too.
//! - CUDA target with `precision = bf16`: the bf16 outputs (layer norms, GELU, attention,
//!   dlogits) hold bf16-rounded values on the CPU engine too; the losses stay within bf16
//!   tolerance of the unfused plan's.
use engine::{CpuEngine, EngineOptions, Rng};
use ir::config::*;
use passes::{PassManager, PassOptions};

fn config(target: TargetConfig, soap: bool) -> Config {
    let optimizer = match soap {
        false => OptimizerConfig::Adamw(AdamWConfig {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }),
        true => OptimizerConfig::Soap(SoapConfig {
            lr: 3e-3,
            beta1: 0.95,
            beta2: 0.95,
            shampoo_beta: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
            precondition_frequency: 3,
            max_precond_dim: 64,
            correct_bias: true,
            normalize_grads: false,
            block_size: None,
        }),
    };
    Config {
        name: "fuse-train".into(),
        // Widths multiples of 8 so that the bias epilogues also apply under bf16 GEMMs.
        model: ModelConfig {
            family: Family::Gpt2,
            vocab_size: 40,
            context: 8,
            d_model: 16,
            n_layers: 2,
            n_heads: 2,
            mlp_hidden: 32,
            norm_eps: 1e-5,
            init_std: 0.02,
            rope_theta: 10000.0,
        },
        optimizer,
        data: DataConfig {
            corpus: CorpusConfig::Builtin,
            tokenizer: TokenizerKind::Bytes,
            batch_size: 3,
            seq_len: 8,
            val_fraction: 0.1,
        },
        train: TrainConfig {
            steps: 8,
            warmup_steps: 0,
            min_lr_ratio: 0.1,
            grad_clip: Some(1.0),
            eval_interval: 0,
            eval_batches: 1,
            seed: 5,
            rematerialize: Default::default(),
            max_skipped_steps: Some(10),
            refresh_swap: Default::default(),
            grad_accum: 1,
        },
        target,
    }
}

fn cpu() -> TargetConfig {
    TargetConfig::Cpu {
        threads: Some(2),
        staleness: 0,
        calibration: None,
        eigensolver: Default::default(),
        budgets: Default::default(),
    }
}

fn cuda_bf16() -> TargetConfig {
    TargetConfig::Cuda {
        device: 0,
        staleness: 0,
        precision: schedule::Precision::Bf16,
        calibration: None,
        eigensolver: Default::default(),
        attention: Default::default(),
        refresh_placement: Default::default(),
        weight_casts: Default::default(),
        budgets: Default::default(),
    }
}

fn compile(config: Config, fuse: bool) -> schedule::Plan {
    let mut m = ir::Module::new(config);
    let mut pm = PassManager::new(PassOptions {
        skip: if fuse { vec![] } else { vec!["fuse".into()] },
        ..Default::default()
    })
    .expect("pass manager");
    let (cx, _) = pm
        .run(&mut m, None, &mut std::io::sink())
        .expect("pipeline");
    cx.plan.expect("plan")
}

/// Losses of `steps` steps on one fixed batch (synchronous refreshes, 2 threads).
fn train(plan: schedule::Plan, steps: u64) -> Vec<f64> {
    let n = plan.data.batch_size * plan.data.seq_len;
    let opts = EngineOptions {
        threads: Some(2),
        synchronous_refresh: true,
        ..EngineOptions::default()
    };
    let mut e = CpuEngine::<f32>::new(plan, opts).expect("engine");
    let mut rng = Rng::new(17);
    let x: Vec<i32> = (0..n).map(|_| (rng.next_u64() % 40) as i32).collect();
    let y: Vec<i32> = x.iter().map(|&t| (t * 7 + 3) % 40).collect();
    let mut losses = Vec::new();
    for t in 1..=steps {
        e.load_batch(&x, &y).expect("batch");
        losses.push(e.forward().expect("forward"));
        e.backward().expect("backward");
        e.optimizer_step(t, 1.0).expect("optimizer");
        e.run_host_tasks(t).expect("host tasks");
    }
    losses
}

fn count(plan: &schedule::Plan, name: &str) -> usize {
    plan.forward.iter().filter(|o| o.name() == name).count()
}

#[test]
fn bias_epilogues_train_bit_identically_on_the_cpu() {
    for soap in [false, true] {
        let fused = compile(config(cpu(), soap), true);
        let unfused = compile(config(cpu(), soap), false);
        assert_eq!(count(&fused, "mat_mul_bias"), 8);
        assert_eq!(count(&unfused, "mat_mul_bias"), 0);
        let (a, b) = (train(fused, 6), train(unfused, 6));
        assert!(a[5] < a[0], "the loss falls: {a:?}");
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b), "soap {soap}: {a:?} vs {b:?}");
    }
}

/// `soap-update`: the composed SOAP step `expand-optimizer` writes (`project`, moments rule,
/// `project` back, step rule) and the `soap_update` op `fuse` selects for it train
/// bit-identically on the CPU engine, through refreshes (frequency 3), for every side pattern
/// (both sides rotated, one side over `max_precond_dim`, 1-D parameters unrotated), with and
/// without weight decay and bias correction, and for blocked SOAP. The fused plan has one
/// `soap_update` per SOAP parameter (or block) and no `project`; the unfused one the reverse.
#[test]
fn soap_update_fusion_trains_bit_identically_on_the_cpu() {
    for (max_precond_dim, wd, correct_bias, block_size) in [
        (64, 0.01, true, None),
        (24, 0.0, false, None),
        (64, 0.1, true, Some(12)),
    ] {
        let mut cfg = config(cpu(), true);
        if let OptimizerConfig::Soap(c) = &mut cfg.optimizer {
            c.max_precond_dim = max_precond_dim;
            c.weight_decay = wd;
            c.correct_bias = correct_bias;
            c.block_size = block_size;
        }
        let fused = compile(cfg.clone(), true);
        let composed = compile(cfg, false);
        let ops = |p: &schedule::Plan, name: &str| {
            p.optimizer.iter().filter(|o| o.name() == name).count()
        };
        let steps = ops(&composed, "elementwise_update") / 2;
        assert!(steps > 0);
        assert_eq!(ops(&fused, "soap_update"), steps);
        assert_eq!(
            ops(&fused, "project") + ops(&fused, "elementwise_update"),
            0
        );
        assert_eq!(ops(&composed, "soap_update"), 0);
        assert!(ops(&composed, "project") > 0);
        let (a, b) = (train(fused, 8), train(composed, 8));
        assert!(a[7] < a[0], "the loss falls: {a:?}");
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&a),
            bits(&b),
            "max_precond_dim {max_precond_dim}, wd {wd}, block {block_size:?}: {a:?} vs {b:?}"
        );
    }
}

/// `shampoo-update`: the composed Shampoo step `expand-optimizer` writes
/// (`shampoo_factor_update`, moments rule, `shampoo_precondition`, `graft`, step rule) and the
/// `shampoo_update` op `fuse` selects for it train bit-identically on the CPU engine, through
/// inverse-root refreshes (frequency 2), with several blocks per matrix (blocks of 12 on
/// 16-, 32- and 40-wide sides, uneven ones among them), vector blocks (1-D parameters), β₂ = 1
/// (a running sum) and < 1 (bias-corrected storage), with and without grafting and weight
/// decay. The fused plan has one `shampoo_update` per parameter and none of the composed ops;
/// the unfused one the reverse.
#[test]
fn shampoo_update_fusion_trains_bit_identically_on_the_cpu() {
    for (block, beta2, grafting, wd, bias) in [
        (12, 1.0, true, 0.0, true),
        (64, 0.95, false, 0.01, true),
        (12, 0.9, true, 0.1, false),
    ] {
        let mut cfg = config(cpu(), false);
        cfg.optimizer = OptimizerConfig::Shampoo(ShampooConfig {
            lr: 3e-3,
            beta1: 0.9,
            beta2,
            epsilon: 1e-8,
            weight_decay: wd,
            max_preconditioner_dim: block,
            precondition_frequency: 2,
            use_bias_correction: bias,
            grafting,
            grafting_beta2: 0.999,
            grafting_epsilon: 1e-10,
        });
        let fused = compile(cfg.clone(), true);
        let composed = compile(cfg, false);
        let ops = |p: &schedule::Plan, name: &str| {
            p.optimizer.iter().filter(|o| o.name() == name).count()
        };
        let steps = ops(&composed, "shampoo_factor_update");
        assert!(steps > 0);
        assert_eq!(ops(&composed, "elementwise_update"), 2 * steps);
        assert_eq!(ops(&composed, "shampoo_precondition"), steps);
        assert_eq!(ops(&composed, "graft"), if grafting { steps } else { 0 });
        assert_eq!(ops(&composed, "shampoo_update"), 0);
        assert_eq!(ops(&fused, "shampoo_update"), steps);
        for name in [
            "shampoo_factor_update",
            "elementwise_update",
            "shampoo_precondition",
            "graft",
        ] {
            assert_eq!(ops(&fused, name), 0, "{name}");
        }
        let (a, b) = (train(fused, 8), train(composed, 8));
        assert!(a[7] < a[0], "the loss falls: {a:?}");
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&a),
            bits(&b),
            "block {block}, beta2 {beta2}, grafting {grafting}: {a:?} vs {b:?}"
        );
    }
}

/// `kl-shampoo-update`: the composed KL-Shampoo step (momentum rule, `project`, `kl_scale`,
/// `project` back, step rule, `kl_factor_update`) and the `kl_shampoo_update` op `fuse` selects
/// for it train bit-identically on the CPU engine, through QR basis refreshes (frequency 2),
/// with both sides preconditioned, one side over `max_precond_dim` (the 40-row embedding at
/// 24), no side preconditioned (at 4: only the eigenvalue estimates, no projections), and with
/// and without weight decay. 1-D parameters take AdamW either way.
#[test]
fn kl_shampoo_update_fusion_trains_bit_identically_on_the_cpu() {
    for (max_precond_dim, wd) in [(64, 0.01), (24, 0.0), (4, 0.01)] {
        let mut cfg = config(cpu(), false);
        cfg.optimizer = OptimizerConfig::KlShampoo(KlShampooConfig {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.98,
            shampoo_beta: 0.98,
            eps: 1e-8,
            weight_decay: wd,
            precondition_frequency: 2,
            init_factor: 0.1,
            max_clamp_value: 4000.0,
            max_precond_dim,
            normalize_grads: false,
        });
        let fused = compile(cfg.clone(), true);
        let composed = compile(cfg, false);
        let ops = |p: &schedule::Plan, name: &str| {
            p.optimizer.iter().filter(|o| o.name() == name).count()
        };
        let steps = ops(&composed, "kl_factor_update");
        assert!(steps > 0);
        assert_eq!(ops(&composed, "kl_scale"), steps);
        assert_eq!(ops(&composed, "kl_shampoo_update"), 0);
        assert_eq!(ops(&fused, "kl_shampoo_update"), steps);
        for name in ["kl_factor_update", "kl_scale", "project"] {
            assert_eq!(ops(&fused, name), 0, "{name}");
        }
        let (a, b) = (train(fused, 8), train(composed, 8));
        assert!(a[7] < a[0], "the loss falls: {a:?}");
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&a),
            bits(&b),
            "max_precond_dim {max_precond_dim}, wd {wd}: {a:?} vs {b:?}"
        );
    }
}

fn cuda_fp32() -> TargetConfig {
    match cuda_bf16() {
        TargetConfig::Cuda {
            device,
            staleness,
            calibration,
            eigensolver,
            attention,
            refresh_placement,
            budgets,
            weight_casts,
            ..
        } => TargetConfig::Cuda {
            device,
            staleness,
            precision: schedule::Precision::Fp32,
            calibration,
            eigensolver,
            attention,
            refresh_placement,
            weight_casts,
            budgets,
        },
        other => other,
    }
}

/// CUDA fp32: the bias epilogues and `clip-into-update` (the clip writes its factor, AdamW
/// reads `grad · factor`) train bit-identically to the unfused plan on the CPU engine, with a
/// clip threshold low enough that every step clips.
#[test]
fn clip_into_update_trains_bit_identically_on_the_cpu() {
    let mut cfg = config(cuda_fp32(), false);
    cfg.train.grad_clip = Some(0.05);
    let fused = compile(cfg.clone(), true);
    let unfused = compile(cfg, false);
    let scaled = |p: &schedule::Plan| {
        p.optimizer
            .iter()
            .filter(|o| {
                matches!(
                    o,
                    schedule::Op::AdamW {
                        grad_scale: Some(_),
                        ..
                    }
                )
            })
            .count()
    };
    assert!(scaled(&fused) > 0 && scaled(&unfused) == 0);
    let (a, b) = (train(fused, 6), train(unfused, 6));
    assert!(a[5] < a[0], "the loss falls: {a:?}");
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a), bits(&b), "{a:?} vs {b:?}");
}

#[test]
fn bf16_outputs_train_within_bf16_tolerance() {
    for soap in [false, true] {
        let fused = compile(config(cuda_bf16(), soap), true);
        let unfused = compile(config(cuda_bf16(), soap), false);
        let casts: Vec<schedule::BufferId> = fused
            .forward
            .iter()
            .chain(&fused.backward)
            .filter_map(|o| match o {
                schedule::Op::Cast { out, .. } => Some(*out),
                schedule::Op::SumRowsCast { out_bf16, .. } => Some(*out_bf16),
                _ => None,
            })
            .collect();
        let bf16 = fused
            .buffers
            .iter()
            .enumerate()
            .filter(|(i, b)| {
                b.dtype == schedule::DType::Bf16 && !casts.contains(&schedule::BufferId(*i as u32))
            })
            .count();
        // Per block ln_1, ln_2, attention, gelu, qkv, the attention's output gradient (read
        // only by the tensor-core attention), fc, GELU's output gradient (read only by GELU and
        // its backward) and its input gradient (read by GEMMs and the bias gradient's sums);
        // ln_f; logits and dlogits; every other GEMM operand is cast (the CPU engine rounds the
        // casts as the GPU does).
        assert_eq!(bf16, 2 * 9 + 3);
        assert!(!casts.is_empty());
        assert_eq!(count(&fused, "mat_mul_bias"), 8);
        let (a, b) = (train(fused, 6), train(unfused, 6));
        assert!(a[5] < a[0], "the loss falls: {a:?}");
        assert_ne!(a, b, "bf16 rounding must show in the losses");
        for (x, y) in a.iter().zip(&b) {
            assert!(
                (x - y).abs() <= 1e-2 * y.abs(),
                "soap {soap}: fused {a:?} vs unfused {b:?}"
            );
        }
    }
}

/// The CUDA engine runs a composed SOAP step (`project`, the rules with results), a CUDA
/// target's default; its device-memory estimate (`schedule::reserve::engine_reserve`, which budgets
/// and `tier-placement` use) counts what the engine allocates for it: the bf16 shadows of the
/// bases `project` reads and `project`'s scratch, as for the hand-written `soap_update`.
#[test]
fn composed_soap_step_is_in_the_cuda_engine_reserve() {
    use schedule::reserve::{engine_reserve, project_scratch_len};
    // On a CUDA target `soap-update` applies only when asked (`--apply-rule`): the composed step
    // is the default there.
    let fused = {
        let mut m = ir::Module::new(config(cuda_bf16(), true));
        let mut pm = PassManager::new(PassOptions {
            apply_rules: vec!["soap-update".into()],
            ..Default::default()
        })
        .expect("pass manager");
        let (cx, _) = pm
            .run(&mut m, None, &mut std::io::sink())
            .expect("pipeline");
        cx.plan.expect("plan")
    };
    let composed = compile(config(cuda_bf16(), true), true);
    let projects: Vec<(usize, usize, bool, bool)> = composed
        .optimizer
        .iter()
        .filter_map(|o| match o {
            schedule::Op::Project {
                x,
                basis_left,
                basis_right,
                ..
            } => {
                let s = &composed.buffer(*x).shape;
                Some((s[0], s[1], basis_left.is_some(), basis_right.is_some()))
            }
            _ => None,
        })
        .collect();
    assert!(
        !projects.is_empty(),
        "the unfused plan keeps SOAP's steps composed"
    );
    assert!(fused.optimizer.iter().all(|o| o.name() != "project"));
    let (rf, rc) = (engine_reserve(&fused, 0), engine_reserve(&composed, 0));
    // The same bases are shadowed either way.
    assert!(rc.basis_shadows > 0);
    assert_eq!(rc.basis_shadows, rf.basis_shadows);
    let need = projects
        .iter()
        .map(|&(m, n, l, r)| project_scratch_len(m, n, l, r, true) * 4)
        .max()
        .unwrap();
    assert!(
        rc.scratch >= need,
        "scratch {} < project's {need} bytes",
        rc.scratch
    );
}
