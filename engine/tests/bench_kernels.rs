//! Timing of the kernels that dominate the tiny GPT-2-vocabulary step (ignored by default):
//! `cargo test --release -p asteria-engine --test bench_kernels -- --ignored --nocapture`.
use engine::cpu::attention::{attention_backward, attention_forward, AttnDims};
use engine::cpu::cross_entropy::{cross_entropy_backward, cross_entropy_forward};
use engine::cpu::matmul::{matmul, Dims};
use std::time::Instant;

fn time(what: &str, reps: usize, mut f: impl FnMut()) {
    f();
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    eprintln!(
        "{what}: {:.2} ms",
        t.elapsed().as_secs_f64() * 1e3 / reps as f64
    );
}

#[test]
#[ignore]
fn kernel_times() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("pool");
    pool.install(|| {
        let (n, c, v) = (1024, 64, 50257);
        let x: Vec<f32> = (0..n * c)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3)
            .collect();
        let w: Vec<f32> = (0..v * c)
            .map(|i| ((i * 104729) % 1000) as f32 * 1e-3)
            .collect();
        let mut logits = vec![0.0f32; n * v];
        let nd = Dims { rows: n, cols: c };
        let wd = Dims { rows: v, cols: c };
        let ld = Dims { rows: n, cols: v };
        time("logits = x wteᵀ [1024x64]·[64x50257]", 3, || {
            matmul(&x, nd, &w, wd, &mut logits, false, true, false).expect("ok")
        });
        let mut dx = vec![0.0f32; n * c];
        time("dx = dlogits wte", 3, || {
            matmul(&logits, ld, &w, wd, &mut dx, false, false, false).expect("ok")
        });
        let mut dw = vec![0.0f32; v * c];
        time("dwte += dlogitsᵀ x", 3, || {
            matmul(&logits, ld, &x, nd, &mut dw, true, false, true).expect("ok")
        });
        let targets: Vec<i32> = (0..n as i32).map(|i| i * 31 % v as i32).collect();
        time("cross_entropy_forward", 3, || {
            cross_entropy_forward(&logits, &targets, v).expect("ok");
        });
        let mut dl = vec![0.0f32; n * v];
        time("cross_entropy_backward", 3, || {
            cross_entropy_backward(&logits, &targets, &mut dl, v).expect("ok")
        });
        let d = AttnDims {
            batch: 16,
            seq_len: 64,
            n_heads: 4,
            channels: 64,
        };
        let qkv: Vec<f32> = (0..n * 3 * c)
            .map(|i| ((i * 31) % 100) as f32 * 1e-2)
            .collect();
        let mut out = vec![0.0f32; n * c];
        time("attention forward", 5, || {
            attention_forward(&qkv, &mut out, &d).expect("ok")
        });
        let mut dqkv = vec![0.0f32; n * 3 * c];
        time("attention backward", 5, || {
            attention_backward(&out, &qkv, &mut dqkv, &d).expect("ok")
        });
    });
}

#[test]
#[ignore]
fn exp_and_max_throughput() {
    use engine::cpu::Float;
    let mut v: Vec<f32> = (0..50257 * 64)
        .map(|i| ((i * 7919) % 1000) as f32 * 1e-3)
        .collect();
    let t = Instant::now();
    let mut m = 0.0f32;
    for row in v.chunks(50257) {
        m += f32::max_of(row);
    }
    eprintln!(
        "max fold: {:.2} ns/elem ({m})",
        t.elapsed().as_secs_f64() * 1e9 / v.len() as f64
    );
    let t = Instant::now();
    let mut s = 0.0f32;
    for row in v.chunks_mut(50257) {
        s += f32::exp_shift_sum(row, 1.0);
    }
    eprintln!(
        "exp_shift_sum: {:.2} ns/elem ({s})",
        t.elapsed().as_secs_f64() * 1e9 / v.len() as f64
    );
}

#[test]
#[ignore]
fn dwte_formulations() {
    use faer::linalg::matmul::matmul as fm;
    use faer::{Accum, MatMut, MatRef, Par};
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("pool");
    pool.install(|| {
        let (n, c, v) = (1024, 64, 50257);
        let x: Vec<f32> = (0..n * c)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3)
            .collect();
        let dl: Vec<f32> = (0..n * v)
            .map(|i| ((i * 104729) % 1000) as f32 * 1e-3)
            .collect();
        let mut dw = vec![0.0f32; v * c];
        time("A: dst[V,C] += dlᵀ x", 3, || {
            let a = MatRef::from_row_major_slice(&dl, n, v).transpose();
            let b = MatRef::from_row_major_slice(&x, n, c);
            fm(
                MatMut::from_row_major_slice_mut(&mut dw, v, c),
                Accum::Add,
                a,
                b,
                1.0,
                Par::rayon(2),
            );
        });
        time("B: dstᵀ[C,V] += xᵀ dl", 3, || {
            let a = MatRef::from_row_major_slice(&x, n, c).transpose();
            let b = MatRef::from_row_major_slice(&dl, n, v);
            fm(
                MatMut::from_row_major_slice_mut(&mut dw, v, c).transpose_mut(),
                Accum::Add,
                a,
                b,
                1.0,
                Par::rayon(2),
            );
        });
        time("G: V-blocked dst[V,C] += dlᵀ x, Seq per block", 3, || {
            use rayon::prelude::*;
            let blk = 1024;
            dw.par_chunks_mut(blk * c).enumerate().for_each(|(i, d)| {
                let rows = d.len() / c;
                let a = MatRef::from_row_major_slice_with_stride(&dl[i * blk..], n, rows, v)
                    .transpose();
                let b = MatRef::from_row_major_slice(&x, n, c);
                fm(
                    MatMut::from_row_major_slice_mut(d, rows, c),
                    Accum::Add,
                    a,
                    b,
                    1.0,
                    Par::Seq,
                );
            });
        });
        let mut dx = vec![0.0f32; n * c];
        let w = dw.clone();
        time("C: dx[N,C] = dl wte", 3, || {
            let a = MatRef::from_row_major_slice(&dl, n, v);
            let b = MatRef::from_row_major_slice(&w, v, c);
            fm(
                MatMut::from_row_major_slice_mut(&mut dx, n, c),
                Accum::Replace,
                a,
                b,
                1.0,
                Par::rayon(2),
            );
        });
        time("D: dxᵀ[C,N] = wteᵀ dlᵀ", 3, || {
            let a = MatRef::from_row_major_slice(&w, v, c).transpose();
            let b = MatRef::from_row_major_slice(&dl, n, v).transpose();
            fm(
                MatMut::from_row_major_slice_mut(&mut dx, n, c).transpose_mut(),
                Accum::Replace,
                a,
                b,
                1.0,
                Par::rayon(2),
            );
        });
        let mut lg = vec![0.0f32; n * v];
        time("E: logits[N,V] = x wteᵀ", 3, || {
            let a = MatRef::from_row_major_slice(&x, n, c);
            let b = MatRef::from_row_major_slice(&w, v, c).transpose();
            fm(
                MatMut::from_row_major_slice_mut(&mut lg, n, v),
                Accum::Replace,
                a,
                b,
                1.0,
                Par::rayon(2),
            );
        });
        time("F: logitsᵀ[V,N] = wte xᵀ", 3, || {
            let a = MatRef::from_row_major_slice(&w, v, c);
            let b = MatRef::from_row_major_slice(&x, n, c).transpose();
            fm(
                MatMut::from_row_major_slice_mut(&mut lg, n, v).transpose_mut(),
                Accum::Replace,
                a,
                b,
                1.0,
                Par::rayon(2),
            );
        });
    });
}
