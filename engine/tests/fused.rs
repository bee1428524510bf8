//! The fused ops of the `fuse` pass on the CPU engine, against the unfused ops they replace, on
//! random inputs of awkward sizes, through whole plans (op dispatch and the buffer store):
//! - `bias-epilogue`: `MatMulBias` is bit-identical to `MatMul` + `BiasAdd`, all transposes;
//! - `bf16-output`: a bf16 buffer holds its producer's f32 values rounded to nearest-even bf16
//!   (also through `set_buffer`), and a GEMM reading it computes on exactly those values;
//! - `sum-rows-cast`: `SumRowsCast` is bit-identical to `SumRows` + `Cast`.
mod common;

use common::randn;
use engine::cpu::matmul::{matmul, Dims};
use engine::{CpuEngine, EngineOptions, Rng};
use schedule::*;

/// A one-op-under-test plan: parameters `a`, `b`, `bias` first (so both variants draw the
/// same initial values), then the program `forward` over the activations, ending in a
/// cross-entropy of `out` `[m, p]` (so the plan has a loss).
fn plan(m: usize, bufs: Vec<(&str, Vec<usize>, DType, BufferClass)>, forward: Vec<Op>) -> Plan {
    let mut buffers: Vec<Buffer> = bufs
        .into_iter()
        .map(|(name, shape, dtype, class)| Buffer {
            name: name.into(),
            shape,
            dtype,
            class,
            init: match class {
                BufferClass::Parameter => Init::Normal { std: 1.0 },
                _ => Init::Zeros,
            },
        })
        .collect();
    let mut add = |name: &str, shape: Vec<usize>, dtype, class| {
        buffers.push(Buffer {
            name: name.into(),
            shape,
            dtype,
            class,
            init: Init::Zeros,
        });
        BufferId(buffers.len() as u32 - 1)
    };
    let tokens = add("tokens", vec![m], DType::I32, BufferClass::Input);
    let targets = add("targets", vec![m], DType::I32, BufferClass::Input);
    let loss = add("loss", vec![1], DType::F32, BufferClass::Scalar);
    let out = BufferId(
        buffers
            .iter()
            .position(|b| b.name == "out")
            .expect("an `out` buffer") as u32,
    );
    let mut forward = forward;
    forward.push(Op::CrossEntropy {
        logits: out,
        targets,
        loss,
    });
    let memory = MemoryPlan::unshared(&buffers);
    Plan {
        format: PLAN_FORMAT.into(),
        version: PLAN_VERSION,
        name: "fused".into(),
        buffers,
        params: vec![],
        loss,
        forward,
        backward: vec![],
        optimizer: vec![],
        host_tasks: vec![],
        data: DataPlan {
            corpus: Corpus::Builtin,
            tokenizer: Tokenizer::Bytes,
            batch_size: m,
            seq_len: 1,
            val_fraction: 0.1,
            tokens,
            targets,
        },
        train: TrainPlan {
            steps: 1,
            warmup_steps: 0,
            min_lr_ratio: 0.1,
            eval_interval: 0,
            eval_batches: 1,
            seed: 11,
            rematerialize: Default::default(),
            max_skipped_steps: Some(10),
            refresh_swap: Default::default(),
            grad_accum: 1,
        },
        target: TargetPlan::Cpu {
            threads: Some(2),
            staleness: 0,
            eigensolver: Eigensolver::Faer,
        },
        memory,
        model: None,
    }
}

fn run(p: Plan) -> CpuEngine<f32> {
    let m = p.data.batch_size;
    let mut e = CpuEngine::<f32>::new(p, EngineOptions::default()).expect("valid plan");
    let ids: Vec<i32> = (0..m as i32).map(|i| i % 2).collect();
    e.load_batch(&ids, &ids).expect("batch");
    e.forward().expect("forward");
    e
}

const B: fn(u32) -> BufferId = BufferId;

#[test]
fn mat_mul_bias_is_bit_identical_to_mat_mul_then_bias_add() {
    use BufferClass::*;
    let mut rng = Rng::new(3);
    for _ in 0..12 {
        let size = |rng: &mut Rng| 1 + (rng.next_u64() % 37) as usize;
        let (m, k, p) = (2 + size(&mut rng), size(&mut rng), 2 + size(&mut rng));
        let (ta, tb) = (rng.next_u64() % 2 == 1, rng.next_u64() % 2 == 1);
        let a_shape = if ta { vec![k, m] } else { vec![m, k] };
        let b_shape = if tb { vec![p, k] } else { vec![k, p] };
        let params = vec![
            ("a", a_shape, DType::F32, Parameter),
            ("b", b_shape, DType::F32, Parameter),
            ("bias", vec![p], DType::F32, Parameter),
        ];
        let mut unfused = params.clone();
        unfused.push(("xw", vec![m, p], DType::F32, Activation));
        unfused.push(("out", vec![m, p], DType::F32, Activation));
        let pair = vec![
            Op::MatMul {
                a: B(0),
                b: B(1),
                out: B(3),
                trans_a: ta,
                trans_b: tb,
                accumulate: false,
                micro_accumulate: None,
            },
            Op::BiasAdd {
                x: B(3),
                bias: B(2),
                out: B(4),
            },
        ];
        let mut fused = params;
        fused.push(("out", vec![m, p], DType::F32, Activation));
        let one = vec![Op::MatMulBias {
            a: B(0),
            b: B(1),
            bias: B(2),
            out: B(3),
            trans_a: ta,
            trans_b: tb,
        }];
        let (e1, e2) = (run(plan(m, unfused, pair)), run(plan(m, fused, one)));
        let (y1, y2) = (
            e1.buffer("out").expect("out"),
            e2.buffer("out").expect("out"),
        );
        assert!(y1.iter().any(|&v| v != 0.0));
        let bits = |v: &[f64]| v.iter().map(|&x| (x as f32).to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&y1), bits(&y2), "m {m} k {k} p {p} ta {ta} tb {tb}");
        assert_eq!(
            e1.buffer("loss").expect("loss"),
            e2.buffer("loss").expect("loss")
        );
    }
}

#[test]
fn bf16_outputs_hold_rounded_values_and_gemms_read_them_exactly() {
    use BufferClass::*;
    let (m, k, p) = (9, 13, 6);
    let bufs = |dtype| {
        vec![
            ("a", vec![m, k], DType::F32, Parameter),
            ("b", vec![p, k], DType::F32, Parameter),
            ("g", vec![m, k], dtype, Activation),
            ("out", vec![m, p], DType::F32, Activation),
            ("b.bf16", vec![p, k], DType::Bf16, Activation),
        ]
    };
    // Under bf16 the GEMM's f32 operand is cast first (`fuse`'s bf16-cast): both operands bf16.
    let prog = |bf16: bool| {
        let mut ops = vec![Op::Gelu { x: B(0), out: B(2) }];
        if bf16 {
            ops.push(Op::Cast { x: B(1), out: B(4) });
        }
        ops.push(Op::MatMul {
            a: B(2),
            b: if bf16 { B(4) } else { B(1) },
            out: B(3),
            trans_a: false,
            trans_b: true,
            accumulate: false,
            micro_accumulate: None,
        });
        ops
    };
    let f32_run = run(plan(m, bufs(DType::F32), prog(false)));
    let mut bf16_run = run(plan(m, bufs(DType::Bf16), prog(true)));
    let g32 = f32_run.buffer("g").expect("g");
    let g16 = bf16_run.buffer("g").expect("g");
    let rounded: Vec<f32> = g32.iter().map(|&v| round_to_bf16(v as f32)).collect();
    assert!(
        g32.iter().zip(&rounded).any(|(&x, &r)| x as f32 != r),
        "rounding must change some values for the test to mean anything"
    );
    let g16_f32: Vec<f32> = g16.iter().map(|&v| v as f32).collect();
    assert_eq!(
        g16_f32, rounded,
        "bf16 buffer = producer output rounded to bf16"
    );
    // The GEMM computes on the rounded values: the same kernel on them by hand.
    let b: Vec<f32> = bf16_run
        .buffer("b")
        .expect("b")
        .iter()
        .map(|&v| round_to_bf16(v as f32))
        .collect();
    let mut want = vec![0f32; m * p];
    matmul(
        &rounded,
        Dims { rows: m, cols: k },
        &b,
        Dims { rows: p, cols: k },
        &mut want,
        false,
        true,
        false,
    )
    .expect("matmul");
    let got: Vec<f32> = bf16_run
        .buffer("out")
        .expect("out")
        .iter()
        .map(|&v| v as f32)
        .collect();
    assert_eq!(got, want);
    // Within bf16's relative precision (2^-8) of the f32 run.
    let out32 = f32_run.buffer("out").expect("out");
    let scale = out32.iter().fold(0f64, |s, v| s.max(v.abs()));
    for (x, y) in got.iter().zip(&out32) {
        assert!((f64::from(*x) - y).abs() <= 0.05 * scale, "{x} vs {y}");
    }
    // Values written from outside are rounded too.
    let mut rng = Rng::new(9);
    let v = randn(&mut rng, m * k, 1.0);
    bf16_run.set_buffer("g", &v).expect("set");
    let back = bf16_run.buffer("g").expect("g");
    for (x, y) in v.iter().zip(&back) {
        assert_eq!(*y as f32, round_to_bf16(*x as f32));
    }
}

#[test]
fn a_saving_attention_writes_the_base_2_log_sum_exp_of_its_scaled_scores() {
    use BufferClass::*;
    // B = 2 sequences of T = 5, NH = 3 heads of 4: qkv [10, 36].
    let (b, t, nh, hd) = (2, 5, 3, 4);
    let (n, c) = (b * t, nh * hd);
    let bufs = vec![
        ("qkv", vec![n, 3 * c], DType::F32, Parameter),
        ("w", vec![4, c], DType::F32, Parameter),
        ("att", vec![n, c], DType::F32, Activation),
        ("lse", vec![b * nh * t], DType::F32, Activation),
        ("out", vec![n, 4], DType::F32, Activation),
    ];
    let prog = |lse| {
        vec![
            Op::Attention {
                qkv: B(0),
                out: B(2),
                lse,
                batch: b,
                seq_len: t,
                n_heads: nh,
            },
            Op::MatMul {
                a: B(2),
                b: B(1),
                out: B(4),
                trans_a: false,
                trans_b: true,
                accumulate: false,
                micro_accumulate: None,
            },
        ]
    };
    let saving = run(plan(n, bufs.clone(), prog(Some(B(3)))));
    let plain = run(plan(n, bufs, prog(None)));
    assert_eq!(
        saving.buffer("att").expect("att"),
        plain.buffer("att").expect("att"),
        "saving the statistics does not change the output"
    );
    let qkv = saving.buffer("qkv").expect("qkv");
    let lse = saving.buffer("lse").expect("lse");
    let scale = 1.0 / (hd as f64).sqrt();
    for bb in 0..b {
        for h in 0..nh {
            for i in 0..t {
                let q = |e: usize| qkv[(bb * t + i) * 3 * c + h * hd + e];
                let k = |j: usize, e: usize| qkv[(bb * t + j) * 3 * c + c + h * hd + e];
                let z: f64 = (0..=i)
                    .map(|j| ((0..hd).map(|e| q(e) * k(j, e)).sum::<f64>() * scale).exp())
                    .sum();
                let got = lse[(bb * nh + h) * t + i];
                assert!(
                    (got - z.log2()).abs() < 1e-5,
                    "b {bb} h {h} t {i}: {got} vs {}",
                    z.log2()
                );
            }
        }
    }
}

/// `sum-rows-cast`: `SumRowsCast` gives the column sums of `SumRows` and the bf16 copy of
/// `Cast` bit for bit (awkward sizes: one row, odd widths).
#[test]
fn sum_rows_cast_is_sum_rows_and_cast() {
    use BufferClass::*;
    for (m, k, p) in [(1, 5, 3), (9, 13, 6), (37, 31, 7)] {
        let bufs = vec![
            ("a", vec![m, k], DType::F32, Parameter),
            ("b", vec![p, k], DType::F32, Parameter),
            ("g", vec![m, k], DType::F32, Activation),
            ("sums", vec![k], DType::F32, Activation),
            ("g.bf16", vec![m, k], DType::Bf16, Activation),
            ("b.bf16", vec![p, k], DType::Bf16, Activation),
            ("out", vec![m, p], DType::F32, Activation),
        ];
        let prog = |fused: bool| {
            let mut ops = vec![Op::Gelu { x: B(0), out: B(2) }];
            if fused {
                ops.push(Op::SumRowsCast {
                    x: B(2),
                    out: B(3),
                    out_bf16: B(4),
                });
            } else {
                ops.push(Op::SumRows { x: B(2), out: B(3) });
                ops.push(Op::Cast { x: B(2), out: B(4) });
            }
            ops.push(Op::Cast { x: B(1), out: B(5) });
            ops.push(Op::MatMul {
                a: B(4),
                b: B(5),
                out: B(6),
                trans_a: false,
                trans_b: true,
                accumulate: false,
                micro_accumulate: None,
            });
            ops
        };
        let (e1, e2) = (
            run(plan(m, bufs.clone(), prog(false))),
            run(plan(m, bufs, prog(true))),
        );
        for name in ["sums", "g.bf16", "out", "loss"] {
            let (x, y) = (e1.buffer(name).expect(name), e2.buffer(name).expect(name));
            assert!(x.iter().any(|&v| v != 0.0), "{name} m {m} k {k}");
            assert_eq!(x, y, "{name} m {m} k {k}");
        }
    }
}
