//! Every kernel's backward against central finite differences in f64 on random inputs of
//! awkward sizes, through the random projection loss `L = Σ r ⊙ out` (so every output element
//! matters). Tolerance: relative error ≤ 1e-6.
mod common;

use common::{assert_close, numeric_grad, project, rand_ids, randn};
use engine::cpu::attention::{attention_backward, attention_forward, AttnDims};
use engine::cpu::matmul::{matmul, Dims};
use engine::cpu::rope::{rope_backward, rope_forward, RopeDims};
use engine::cpu::{
    cross_entropy as ce, elementwise as ew, embedding as emb, norms, positional as pos,
};
use engine::Rng;

const H: f64 = 1e-5;
const TOL: f64 = 1e-6;

#[test]
fn embedding_backward_matches_finite_differences() {
    let mut rng = Rng::new(1);
    let (v, c, n) = (7, 5, 11);
    let table = randn(&mut rng, v * c, 1.0);
    let mut ids = rand_ids(&mut rng, n, v);
    ids[3] = ids[0]; // a repeated id must accumulate
    let r = randn(&mut rng, n * c, 1.0);
    let loss = |t: &[f64]| {
        let mut out = vec![0.0; n * c];
        emb::embedding_forward(t, v, c, &ids, &mut out).expect("valid ids");
        project(&r, &out)
    };
    let mut dtable = vec![f64::NAN; v * c];
    emb::embedding_backward(&r, &ids, &mut dtable, v, c).expect("valid ids");
    assert_close("dtable", &dtable, &numeric_grad(&table, H, loss), TOL);
}

#[test]
fn positional_backward_matches_finite_differences() {
    let mut rng = Rng::new(2);
    let (b, t, p, c) = (3, 4, 6, 5);
    let x = randn(&mut rng, b * t * c, 1.0);
    let pe = randn(&mut rng, p * c, 1.0);
    let r = randn(&mut rng, b * t * c, 1.0);
    let loss = |x: &[f64], pe: &[f64]| {
        let mut out = vec![0.0; b * t * c];
        pos::add_positional(x, pe, &mut out, c, t).expect("sizes");
        project(&r, &out)
    };
    let mut dpos = vec![f64::NAN; p * c];
    pos::add_positional_backward(&r, &mut dpos, c, t).expect("sizes");
    assert_close("dpos", &dpos, &numeric_grad(&pe, H, |pe| loss(&x, pe)), TOL);
    assert_close(
        "dx (= dout)",
        &r,
        &numeric_grad(&x, H, |x| loss(x, &pe)),
        TOL,
    );
}

fn layernorm_case(with_bias: bool) {
    let mut rng = Rng::new(3);
    let (n, c, eps) = (7, 13, 1e-5);
    let x = randn(&mut rng, n * c, 2.0);
    let w = randn(&mut rng, c, 1.0);
    let b = randn(&mut rng, c, 1.0);
    let r = randn(&mut rng, n * c, 1.0);
    let loss = |x: &[f64], w: &[f64], b: &[f64]| {
        let mut out = vec![0.0; n * c];
        norms::layernorm_forward(x, w, with_bias.then_some(b), &mut out, c, eps).expect("sizes");
        project(&r, &out)
    };
    let (mut dx, mut dw, mut db) = (vec![f64::NAN; n * c], vec![f64::NAN; c], vec![f64::NAN; c]);
    let dbias = if with_bias {
        Some(db.as_mut_slice())
    } else {
        None
    };
    norms::layernorm_backward(&r, &x, &w, &mut dx, &mut dw, dbias, c, eps).expect("sizes");
    assert_close(
        "layernorm dx",
        &dx,
        &numeric_grad(&x, H, |x| loss(x, &w, &b)),
        TOL,
    );
    assert_close(
        "layernorm dweight",
        &dw,
        &numeric_grad(&w, H, |w| loss(&x, w, &b)),
        TOL,
    );
    if with_bias {
        assert_close(
            "layernorm dbias",
            &db,
            &numeric_grad(&b, H, |b| loss(&x, &w, b)),
            TOL,
        );
    }
}

#[test]
fn layernorm_backward_matches_finite_differences() {
    layernorm_case(true);
    layernorm_case(false);
}

#[test]
fn rmsnorm_backward_matches_finite_differences() {
    let mut rng = Rng::new(4);
    let (n, c, eps) = (9, 11, 1e-6);
    let x = randn(&mut rng, n * c, 1.5);
    let w = randn(&mut rng, c, 1.0);
    let r = randn(&mut rng, n * c, 1.0);
    let loss = |x: &[f64], w: &[f64]| {
        let mut out = vec![0.0; n * c];
        norms::rmsnorm_forward(x, w, &mut out, c, eps).expect("sizes");
        project(&r, &out)
    };
    let (mut dx, mut dw) = (vec![f64::NAN; n * c], vec![f64::NAN; c]);
    norms::rmsnorm_backward(&r, &x, &w, &mut dx, &mut dw, c, eps).expect("sizes");
    assert_close(
        "rmsnorm dx",
        &dx,
        &numeric_grad(&x, H, |x| loss(x, &w)),
        TOL,
    );
    assert_close(
        "rmsnorm dweight",
        &dw,
        &numeric_grad(&w, H, |w| loss(&x, w)),
        TOL,
    );
}

/// Stored dims of an operand that is logically `[r, c]`, transposed when `t`.
fn stored(r: usize, c: usize, t: bool) -> Dims {
    if t {
        Dims { rows: c, cols: r }
    } else {
        Dims { rows: r, cols: c }
    }
}

#[test]
fn matmul_gradients_for_every_transpose_combination() {
    let (m, k, p) = (5, 7, 3);
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let mut rng = Rng::new(5);
        let (ad, bd) = (stored(m, k, ta), stored(k, p, tb));
        let a = randn(&mut rng, m * k, 1.0);
        let b = randn(&mut rng, k * p, 1.0);
        let r = randn(&mut rng, m * p, 1.0);
        let loss = |a: &[f64], b: &[f64]| {
            let mut out = vec![0.0; m * p];
            matmul(a, ad, b, bd, &mut out, ta, tb, false).expect("sizes");
            project(&r, &out)
        };
        let rd = Dims { rows: m, cols: p };
        // The rules the compiler's autodiff emits, written with the same kernel.
        let mut da = vec![0.0; m * k];
        if ta {
            matmul(&b, bd, &r, rd, &mut da, tb, true, false).expect("sizes");
        } else {
            matmul(&r, rd, &b, bd, &mut da, false, !tb, false).expect("sizes");
        }
        let mut db = vec![0.0; k * p];
        if tb {
            matmul(&r, rd, &a, ad, &mut db, true, ta, false).expect("sizes");
        } else {
            matmul(&a, ad, &r, rd, &mut db, !ta, false, false).expect("sizes");
        }
        assert_close(
            &format!("matmul ta={ta} tb={tb} da"),
            &da,
            &numeric_grad(&a, H, |a| loss(a, &b)),
            TOL,
        );
        assert_close(
            &format!("matmul ta={ta} tb={tb} db"),
            &db,
            &numeric_grad(&b, H, |b| loss(&a, b)),
            TOL,
        );
    }
}

#[test]
fn bias_add_gradient_is_sum_rows() {
    let mut rng = Rng::new(6);
    let (n, c) = (13, 6);
    let x = randn(&mut rng, n * c, 1.0);
    let bias = randn(&mut rng, c, 1.0);
    let r = randn(&mut rng, n * c, 1.0);
    let loss = |bias: &[f64]| {
        let mut out = vec![0.0; n * c];
        ew::bias_add(&x, bias, &mut out, c).expect("sizes");
        project(&r, &out)
    };
    let mut db = vec![f64::NAN; c];
    ew::sum_rows(&r, &mut db, c).expect("sizes");
    assert_close("dbias", &db, &numeric_grad(&bias, H, loss), TOL);
}

#[test]
fn add_gradient_is_dout() {
    let mut rng = Rng::new(7);
    let a = randn(&mut rng, 17, 1.0);
    let b = randn(&mut rng, 17, 1.0);
    let r = randn(&mut rng, 17, 1.0);
    let loss = |a: &[f64]| {
        let mut out = vec![0.0; 17];
        ew::add(a, &b, &mut out).expect("sizes");
        project(&r, &out)
    };
    assert_close("add da", &r, &numeric_grad(&a, H, loss), TOL);
}

#[test]
fn gelu_backward_matches_finite_differences() {
    let mut rng = Rng::new(8);
    let x = randn(&mut rng, 37, 2.0);
    let r = randn(&mut rng, 37, 1.0);
    let loss = |x: &[f64]| {
        let mut out = vec![0.0; x.len()];
        ew::gelu(x, &mut out).expect("sizes");
        project(&r, &out)
    };
    let mut dx = vec![f64::NAN; 37];
    ew::gelu_backward(&r, &x, &mut dx).expect("sizes");
    assert_close("gelu dx", &dx, &numeric_grad(&x, H, loss), TOL);
}

#[test]
fn swiglu_backward_matches_finite_differences() {
    let mut rng = Rng::new(9);
    let (n, f) = (5, 7);
    let x = randn(&mut rng, n * 2 * f, 2.0);
    let r = randn(&mut rng, n * f, 1.0);
    let loss = |x: &[f64]| {
        let mut out = vec![0.0; n * f];
        ew::swiglu(x, &mut out, f).expect("sizes");
        project(&r, &out)
    };
    let mut dx = vec![f64::NAN; n * 2 * f];
    ew::swiglu_backward(&r, &x, &mut dx, f).expect("sizes");
    assert_close("swiglu dx", &dx, &numeric_grad(&x, H, loss), TOL);
}

#[test]
fn rope_backward_matches_finite_differences() {
    let mut rng = Rng::new(10);
    let d = RopeDims {
        width: 28,
        seq_len: 5,
        head_dim: 6,
        rotated_cols: 18,
        theta: 10000.0,
    };
    let n = 2 * d.seq_len;
    let x = randn(&mut rng, n * d.width, 1.0);
    let r = randn(&mut rng, n * d.width, 1.0);
    let loss = |x: &[f64]| {
        let mut out = vec![0.0; x.len()];
        rope_forward(x, &mut out, &d).expect("sizes");
        project(&r, &out)
    };
    let mut dx = vec![f64::NAN; x.len()];
    rope_backward(&r, &mut dx, &d).expect("sizes");
    assert_close("rope dx", &dx, &numeric_grad(&x, H, loss), TOL);
}

#[test]
fn attention_backward_matches_finite_differences() {
    for (batch, seq_len, n_heads, hd) in [(2, 5, 3, 4), (1, 9, 2, 3)] {
        let mut rng = Rng::new(11);
        let c = n_heads * hd;
        let d = AttnDims {
            batch,
            seq_len,
            n_heads,
            channels: c,
        };
        let n = batch * seq_len;
        let qkv = randn(&mut rng, n * 3 * c, 1.0);
        let r = randn(&mut rng, n * c, 1.0);
        let loss = |qkv: &[f64]| {
            let mut out = vec![0.0; n * c];
            attention_forward(qkv, &mut out, &d).expect("sizes");
            project(&r, &out)
        };
        let mut dqkv = vec![f64::NAN; qkv.len()];
        attention_backward(&r, &qkv, &mut dqkv, &d).expect("sizes");
        assert_close(
            &format!("attention {d:?} dqkv"),
            &dqkv,
            &numeric_grad(&qkv, H, loss),
            TOL,
        );
    }
}

#[test]
fn cross_entropy_backward_matches_finite_differences() {
    let mut rng = Rng::new(12);
    let (n, v) = (6, 11);
    let logits = randn(&mut rng, n * v, 3.0);
    let targets = rand_ids(&mut rng, n, v);
    let scale = 1.7; // L = scale · loss
    let loss =
        |l: &[f64]| scale * ce::cross_entropy_forward(l, &targets, v).expect("valid targets");
    let mut dl = vec![f64::NAN; n * v];
    ce::cross_entropy_backward(&logits, &targets, &mut dl, v).expect("valid targets");
    dl.iter_mut().for_each(|g| *g *= scale);
    assert_close(
        "cross-entropy dlogits",
        &dl,
        &numeric_grad(&logits, H, loss),
        TOL,
    );
}
