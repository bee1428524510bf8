//! The host AdamW kernel (generated with Cranelift from `optim::update::adamw_rule`) against
//! the workspace reference (`optim::adamw_update`, the CPU engine's f64 AdamW) and against
//! `hostkernels::adamw_reference`: bit-identical results (`to_bits`) on awkward lengths,
//! several steps and constant sets; errors instead of panics; the generated IR is vectorised
//! and specialised to the constants.
use hostkernels::{adamw_reference, AdamWConstants, AdamWKernel, KernelError};
use optim::{adamw_update, AdamWParams};

const LENGTHS: [usize; 10] = [0, 1, 3, 4, 5, 7, 8, 1023, 4097, 100_003];
const STEPS: [u64; 4] = [1, 2, 10, 1000];

/// Constant sets: PyTorch defaults, LLM-style, no weight decay, the `lerp` weight ≥ 0.5
/// branch (β₁ ≤ 0.5), and β₁ = 0.5 exactly (the branch boundary).
fn constant_sets() -> Vec<AdamWConstants> {
    vec![
        AdamWConstants {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        },
        AdamWConstants {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        },
        AdamWConstants {
            beta1: 0.85,
            beta2: 0.999,
            eps: 1e-6,
            weight_decay: 0.0,
        },
        AdamWConstants {
            beta1: 0.3,
            beta2: 0.5,
            eps: 1e-3,
            weight_decay: 0.5,
        },
        AdamWConstants {
            beta1: 0.5,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 1e-4,
        },
    ]
}

struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> XorShift {
        XorShift(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// A signed value whose magnitude class is drawn at random: zero, subnormal, tiny,
    /// ordinary, large, or a huge one whose square overflows f32 in `v`.
    fn mixed(&mut self, scale: f32) -> f32 {
        let sign = if self.next() & 1 == 0 { 1.0 } else { -1.0 };
        let u = self.unit() + 0.5;
        let mag = match self.next() % 16 {
            0 => 0.0,
            1 => u * 1e-40, // subnormal
            2 => u * 1e-30,
            3 => u * 1e-12,
            4 => u * 1e4,
            5 => u * 1e15,
            6 if self.next().is_multiple_of(8) => u * 1e20, // g² = inf in f32
            _ => u * scale,
        };
        sign * mag
    }
}

#[derive(Clone)]
struct State {
    param: Vec<f32>,
    grad: Vec<f32>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
}

fn random_state(n: usize, seed: u64) -> State {
    let mut r = XorShift::new(seed);
    let param = (0..n).map(|_| r.mixed(0.5)).collect();
    let grad = (0..n).map(|_| r.mixed(1e-2)).collect();
    let exp_avg = (0..n).map(|_| r.mixed(1e-3)).collect();
    // v ≥ 0 (it is a running mean of g²) and finite; some exact zeros.
    let exp_avg_sq = (0..n)
        .map(|_| {
            let x = r.mixed(1e-3);
            if x.abs() > 1e30 {
                0.0
            } else {
                x * x
            }
        })
        .collect();
    State {
        param,
        grad,
        exp_avg,
        exp_avg_sq,
    }
}

fn first_mismatch(a: &[f32], b: &[f32]) -> Option<(usize, f32, f32)> {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
        .map(|i| (i, a[i], b[i]))
}

fn assert_same(what: &str, ctx: &str, a: &State, b: &State) {
    for (name, x, y) in [
        ("param", &a.param, &b.param),
        ("exp_avg", &a.exp_avg, &b.exp_avg),
        ("exp_avg_sq", &a.exp_avg_sq, &b.exp_avg_sq),
    ] {
        if let Some((i, u, v)) = first_mismatch(x, y) {
            panic!(
                "{ctx}: JIT vs {what}: {name}[{i}] = {u:e} ({:#010x}) vs {v:e} ({:#010x})",
                u.to_bits(),
                v.to_bits()
            );
        }
    }
}

fn lr_for(t: u64) -> f64 {
    // A scheduled lr (plan lr × a multiplier that changes with t).
    3e-4 * (1.0 + (t as f64 * 0.37).sin()) + 1e-5
}

fn run_jit(k: &AdamWKernel, t: u64, lr: f64, s: &mut State) {
    k.update(
        t,
        lr,
        &mut s.param,
        &s.grad,
        &mut s.exp_avg,
        &mut s.exp_avg_sq,
    )
    .unwrap();
}

fn run_optim(c: &AdamWConstants, t: u64, lr: f64, s: &mut State) {
    let hp = AdamWParams {
        lr,
        beta1: c.beta1,
        beta2: c.beta2,
        eps: c.eps,
        weight_decay: c.weight_decay,
    };
    adamw_update::<f32>(
        t,
        &hp,
        &mut s.param,
        &s.grad,
        &mut s.exp_avg,
        &mut s.exp_avg_sq,
    )
    .unwrap();
}

fn run_ref(c: &AdamWConstants, t: u64, lr: f64, s: &mut State) {
    adamw_reference(
        c,
        t,
        lr,
        &mut s.param,
        &s.grad,
        &mut s.exp_avg,
        &mut s.exp_avg_sq,
    )
    .unwrap();
}

/// One step from fresh random state, for every constant set, length and step.
#[test]
fn jit_matches_references_bit_for_bit() {
    let mut checked = 0usize;
    for (ci, c) in constant_sets().iter().enumerate() {
        let k = AdamWKernel::compile(c).unwrap();
        for &n in &LENGTHS {
            for &t in &STEPS {
                let ctx = format!("consts #{ci} {c:?}, n = {n}, t = {t}");
                let init = random_state(n, (ci as u64) << 48 ^ (n as u64) << 16 ^ t);
                let lr = lr_for(t);
                let mut jit = init.clone();
                run_jit(&k, t, lr, &mut jit);
                let mut reference = init.clone();
                run_optim(c, t, lr, &mut reference);
                assert_same("optim::adamw_update", &ctx, &jit, &reference);
                let mut plain = init.clone();
                run_ref(c, t, lr, &mut plain);
                assert_same("adamw_reference", &ctx, &jit, &plain);
                // The update did something (guards against comparing two no-ops).
                if n >= 8 {
                    assert!(
                        first_mismatch(&jit.exp_avg, &init.exp_avg).is_some(),
                        "{ctx}"
                    );
                }
                checked += n;
            }
        }
    }
    assert!(checked > 2_000_000);
}

/// Many consecutive steps on the same state (the moments evolve), lerp branches and wd=0.
#[test]
fn multi_step_trajectories_match() {
    for (ci, c) in constant_sets().iter().enumerate() {
        let k = AdamWKernel::compile(c).unwrap();
        let init = random_state(1027, 77 + ci as u64);
        let (mut jit, mut reference) = (init.clone(), init.clone());
        for t in 1..=50u64 {
            let lr = lr_for(t);
            run_jit(&k, t, lr, &mut jit);
            run_optim(c, t, lr, &mut reference);
            assert_same(
                "optim::adamw_update",
                &format!("consts #{ci}, t = {t}"),
                &jit,
                &reference,
            );
        }
    }
}

/// The largest step the kernel accepts (the reference's `powi` exponent is an i32).
#[test]
fn extreme_steps_match() {
    let c = constant_sets()[1];
    let k = AdamWKernel::compile(&c).unwrap();
    for t in [3u64, 100_000, i32::MAX as u64] {
        let init = random_state(37, t);
        let (mut jit, mut reference) = (init.clone(), init.clone());
        run_jit(&k, t, 1e-3, &mut jit);
        run_optim(&c, t, 1e-3, &mut reference);
        assert_same("optim::adamw_update", &format!("t = {t}"), &jit, &reference);
    }
}

/// Slices long enough to be split into chunks on a multi-threaded rayon pool, and one
/// kernel shared by several threads.
#[test]
fn parallel_chunks_and_shared_kernel_match() {
    let c = constant_sets()[0];
    let k = AdamWKernel::compile(&c).unwrap();
    let n = hostkernels::PARALLEL_MIN_ELEMENTS + 3 * hostkernels::CHUNK_ELEMENTS + 5;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let init = random_state(n, 5);
    let mut jit = init.clone();
    pool.install(|| run_jit(&k, 7, 2e-4, &mut jit));
    let mut reference = init.clone();
    run_optim(&c, 7, 2e-4, &mut reference);
    assert_same("optim::adamw_update", "parallel", &jit, &reference);
    let mut plain = init.clone();
    pool.install(|| run_ref(&c, 7, 2e-4, &mut plain));
    assert_same("adamw_reference", "parallel", &jit, &plain);

    let k = &k;
    std::thread::scope(|s| {
        for i in 0..4u64 {
            s.spawn(move || {
                let init = random_state(5003, 1000 + i);
                let (mut jit, mut reference) = (init.clone(), init.clone());
                run_jit(k, 3, 1e-3, &mut jit);
                run_optim(&c, 3, 1e-3, &mut reference);
                assert_same("optim::adamw_update", "threads", &jit, &reference);
            });
        }
    });
}

#[test]
fn errors_not_panics_and_nothing_modified() {
    let c = constant_sets()[0];
    let k = AdamWKernel::compile(&c).unwrap();
    let init = random_state(9, 1);
    let untouched = |s: &State| {
        assert_same("the input", "after an error", s, &init);
    };

    let mut s = init.clone();
    let e = k
        .update(
            0,
            1e-3,
            &mut s.param,
            &s.grad,
            &mut s.exp_avg,
            &mut s.exp_avg_sq,
        )
        .unwrap_err();
    assert_eq!(e, KernelError::ZeroStep);
    untouched(&s);
    let e = adamw_reference(
        &c,
        0,
        1e-3,
        &mut s.param,
        &s.grad,
        &mut s.exp_avg,
        &mut s.exp_avg_sq,
    )
    .unwrap_err();
    assert_eq!(e, KernelError::ZeroStep);
    untouched(&s);

    let big = i32::MAX as u64 + 1;
    let e = k
        .update(
            big,
            1e-3,
            &mut s.param,
            &s.grad,
            &mut s.exp_avg,
            &mut s.exp_avg_sq,
        )
        .unwrap_err();
    assert_eq!(e, KernelError::StepTooLarge(big));
    untouched(&s);

    let mut short = vec![0f32; 8];
    let e = k
        .update(
            1,
            1e-3,
            &mut short,
            &s.grad,
            &mut s.exp_avg,
            &mut s.exp_avg_sq,
        )
        .unwrap_err();
    assert_eq!(
        e,
        KernelError::LengthMismatch {
            operand: "param",
            expected: 9,
            got: 8
        }
    );
    let e = k
        .update(
            1,
            1e-3,
            &mut s.param,
            &s.grad,
            &mut short,
            &mut s.exp_avg_sq,
        )
        .unwrap_err();
    assert!(matches!(
        e,
        KernelError::LengthMismatch {
            operand: "exp_avg",
            ..
        }
    ));
    let mut long = vec![0f32; 10];
    let e = k
        .update(1, 1e-3, &mut s.param, &s.grad, &mut s.exp_avg, &mut long)
        .unwrap_err();
    assert!(matches!(
        e,
        KernelError::LengthMismatch {
            operand: "exp_avg_sq",
            got: 10,
            ..
        }
    ));
    let e = adamw_reference(
        &c,
        1,
        1e-3,
        &mut s.param,
        &s.grad[..3],
        &mut s.exp_avg,
        &mut s.exp_avg_sq,
    )
    .unwrap_err();
    assert!(matches!(e, KernelError::LengthMismatch { expected: 3, .. }));
    untouched(&s);
    assert_eq!(short, vec![0f32; 8]);
    assert_eq!(long, vec![0f32; 10]);
    assert!(e.to_string().contains("param"), "{e}");
}

#[test]
fn ir_is_vectorised_and_specialised() {
    let c = constant_sets()[1];
    let k = AdamWKernel::compile(&c).unwrap();
    let ir = k.ir_text();
    for needle in ["load.f32x4", "splat.f32x4", "fmul.f32x4", "load.f32 "] {
        assert!(ir.contains(needle), "`{needle}` not in the IR:\n{ir}");
    }
    // The vector body: 4 loads, 3 stores of f32x4, and its sqrt / two divisions.
    assert_eq!(ir.matches("load.f32x4").count(), 4, "{ir}");
    // β₂ = 0.95 and 1 − β₂ baked in as f32 immediates.
    assert!(ir.contains(&format!("f32const {}", hex_f32(0.95))), "{ir}");
    assert!(
        ir.contains(&format!("f32const {}", hex_f32((1.0f64 - 0.95) as f32))),
        "{ir}"
    );
    // No fused multiply-add anywhere (the reference has none).
    assert!(!ir.contains("fma"), "{ir}");
    assert!(!k.optimized_ir_text().contains("fma"));
    #[cfg(target_arch = "x86_64")]
    {
        let asm = k.disasm_text();
        for op in ["sqrtps", "divps", "mulps", "movups"] {
            assert!(asm.contains(op), "`{op}` not in the machine code:\n{asm}");
        }
        assert!(!asm.contains("vfmadd"), "{asm}");
    }
    // Weight decay 0: no decay multiply in the body.
    let k0 = AdamWKernel::compile(&constant_sets()[2]).unwrap();
    assert!(k0.ir_text().matches("fmul").count() < ir.matches("fmul").count());
}

/// Cranelift's CLIF spelling of an f32 immediate (`0x1.e66666p-1`).
fn hex_f32(x: f32) -> String {
    cranelift_codegen::ir::immediates::Ieee32::with_float(x).to_string()
}
