//! Tests of the plan verifier (`verify.rs`).
//! The dtype contract of bf16 buffers and the `mat_mul_bias` operand checks, on the
//! one-matmul plan of the memory tests (`d.logits` is read only by a GEMM).
use crate::memory::tests::plan;
use crate::{
    round_to_bf16, Buffer, BufferClass, BufferId, DType, Init, MemoryPlan, Op, Plan, PlanError,
};

fn with_dtype(mut p: Plan, buffer: usize, dtype: DType) -> Plan {
    p.buffers[buffer].dtype = dtype;
    p.memory = MemoryPlan::unshared(&p.buffers);
    p
}

#[test]
fn a_bf16_gradient_read_only_by_a_gemm_verifies_and_takes_half_the_bytes() {
    // dlogits bf16 alone: its weight-gradient GEMM would mix bf16 and the f32 `x`.
    let err = with_dtype(plan(), 7, DType::Bf16).verify().unwrap_err();
    assert!(
        err.to_string().contains("GEMM operands share one dtype"),
        "{err}"
    );
    // With `x` cast to bf16 for that GEMM (what `fuse`'s bf16-cast inserts) it verifies.
    let mut p = plan();
    p.buffers.push(Buffer {
        name: "x.bf16".into(),
        shape: vec![2, 2],
        dtype: DType::Bf16,
        class: BufferClass::Activation,
        init: Init::Zeros,
    });
    let x16 = BufferId(p.buffers.len() as u32 - 1);
    p.backward.insert(
        1,
        Op::Cast {
            x: BufferId(4),
            out: x16,
        },
    );
    if let Op::MatMul { b, .. } = &mut p.backward[2] {
        *b = x16;
    }
    let p = with_dtype(p, 7, DType::Bf16);
    p.verify().expect("dlogits and the cast x may be bf16");
    assert_eq!(p.buffers[7].size_bytes(), 2 * 3 * 2);
}

#[test]
fn bf16_is_rejected_where_an_engine_reads_or_writes_f32() {
    // `x` is written by an embedding: its output must be f32.
    let err = with_dtype(plan(), 4, DType::Bf16).verify().unwrap_err();
    assert!(
        matches!(&err, PlanError::Operand { operand: "out", problem, .. } if problem == "must be f32"),
        "{err}"
    );
    // bf16 `logits` need the cross-entropy backward to write a bf16 gradient.
    let err = with_dtype(plan(), 5, DType::Bf16).verify().unwrap_err();
    assert!(
        err.to_string().contains("must be bf16 when the logits are"),
        "{err}"
    );
    // A parameter never is.
    let err = with_dtype(plan(), 2, DType::Bf16).verify().unwrap_err();
    assert!(
        err.to_string().contains("only activations may be bf16"),
        "{err}"
    );
}

fn with_bias(shape: &[usize]) -> Plan {
    let mut p = plan();
    p.buffers.push(Buffer {
        name: "bias".into(),
        shape: shape.to_vec(),
        dtype: DType::F32,
        class: BufferClass::Parameter,
        init: Init::Zeros,
    });
    let bias = BufferId(p.buffers.len() as u32 - 1);
    p.forward[1] = Op::MatMulBias {
        a: BufferId(4),
        b: BufferId(2),
        bias,
        out: BufferId(5),
        trans_a: false,
        trans_b: true,
    };
    p.memory = MemoryPlan::unshared(&p.buffers);
    p
}

#[test]
fn mat_mul_bias_checks_the_bias_against_the_product_columns() {
    with_bias(&[3])
        .verify()
        .expect("bias [P] with out [M, P] = [2, 3]");
    let err = with_bias(&[2]).verify().unwrap_err();
    assert!(
        matches!(&err, PlanError::Operand { operand: "bias", problem, .. } if problem == "must have shape [3]"),
        "{err}"
    );
    let ops = with_bias(&[3]).forward[1].accesses();
    let names: Vec<_> = ops.iter().map(|(n, _, a)| (*n, a.writes())).collect();
    assert_eq!(
        names,
        vec![("a", false), ("b", false), ("bias", false), ("out", true)]
    );
}

#[test]
fn bf16_rounding_is_to_nearest_even() {
    let one = 1.0f32;
    let ulp = 2f32.powi(-7); // bf16 spacing in [1, 2)
    assert_eq!(round_to_bf16(one), one);
    assert_eq!(
        round_to_bf16(one + ulp / 2.0),
        one,
        "tie goes to the even 1.0"
    );
    assert_eq!(
        round_to_bf16(one + 1.5 * ulp),
        one + 2.0 * ulp,
        "tie goes to even"
    );
    assert_eq!(round_to_bf16(one + 0.51 * ulp), one + ulp);
    assert_eq!(round_to_bf16(-(one + 0.49 * ulp)), -one);
    assert_eq!(round_to_bf16(f32::INFINITY), f32::INFINITY);
    assert_eq!(round_to_bf16(f32::MAX), f32::INFINITY);
    assert!(round_to_bf16(f32::NAN).is_nan());
    // Against the nearest of the two bf16 neighbours, on a spread of bit patterns.
    let mut bits = 0x1234_5678u32;
    for _ in 0..100_000 {
        bits = bits.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let x = f32::from_bits(bits);
        if !x.is_finite() || x.abs() > 1e38 {
            continue;
        }
        let r = round_to_bf16(x);
        assert_eq!(r.to_bits() & 0xffff, 0, "{x:e} -> {r:e} is not a bf16");
        let down = f32::from_bits(bits & 0xffff_0000);
        let up = f32::from_bits((bits & 0xffff_0000) + 0x1_0000);
        let (dd, du) = (
            (f64::from(x) - f64::from(down)).abs(),
            (f64::from(up) - f64::from(x)).abs(),
        );
        let best = if dd < du {
            down
        } else if du < dd {
            up
        } else {
            r
        };
        assert_eq!(r, best, "{x:e}: got {r:e}, nearest {best:e}");
    }
}

#[test]
fn a_shard_corpus_needs_a_training_shard_and_the_gpt2_tokenizer() {
    use crate::{Corpus, Tokenizer};
    let mut p = plan();
    p.data.corpus = Corpus::Shards {
        train: vec!["fineweb_train_000001.bin".into()],
        val: vec![],
    };
    p.data.tokenizer = Tokenizer::Gpt2;
    p.verify().expect("one training shard, gpt2 ids");
    let mut bytes = p.clone();
    bytes.data.tokenizer = Tokenizer::Bytes;
    let err = bytes.verify().unwrap_err();
    assert!(
        err.to_string().contains("the tokenizer must be `gpt2`"),
        "{err}"
    );
    p.data.corpus = Corpus::Shards {
        train: vec![],
        val: vec!["fineweb_val_000000.bin".into()],
    };
    let err = p.verify().unwrap_err();
    assert!(err.to_string().contains("lists no training shard"), "{err}");
}
