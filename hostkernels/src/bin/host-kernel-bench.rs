//! `host-kernel-bench`: times the host AdamW kernel ([`AdamWKernel::update`], generated with
//! Cranelift from `optim::update::adamw_rule`, the rule every rule-defined optimizer's host
//! kernel is generated like) against the rustc-compiled reference loop ([`adamw_reference`]) on
//! the same number of threads.
//!
//! ```text
//! host-kernel-bench [--elements N]... [--reps R] [--threads T] [--print]
//! ```
//!
//! - `--elements N`: f32 elements per array (repeatable; default 16M and 64M, i.e.
//!   16777216 and 67108864). Two full sets of 4 arrays are allocated (32·N bytes).
//! - `--reps R`: timed steps per variant (default 9), after one untimed warm-up step each.
//! - `--threads T`: rayon pool size for both variants (default: available parallelism).
//! - `--print`: print the kernel's CLIF (generated and optimized) and machine-code
//!   disassembly first.
//!
//! Each repetition runs one step of each variant on its own copy of the state (the copies
//! start equal and stay bit-identical; the variants trade copies every step and alternate
//! which goes first, so memory placement and ordering effects are shared) and the medians are
//! reported in ms and GB/s, counting 28 bytes per element (param, grad, exp_avg, exp_avg_sq
//! read; param, exp_avg, exp_avg_sq written; 4 bytes each). The final states of the two copies
//! are compared bit for bit.
use std::process::ExitCode;
use std::time::Instant;

use hostkernels::{adamw_reference, AdamWConstants, AdamWKernel};

struct Args {
    elements: Vec<usize>,
    reps: usize,
    threads: usize,
    print: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        elements: Vec::new(),
        reps: 9,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        print: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| -> Result<usize, String> {
            let v = it.next().ok_or(format!("{name} needs a value"))?;
            v.parse::<usize>().map_err(|e| format!("{name} {v}: {e}"))
        };
        match a.as_str() {
            "--elements" | "-n" => args.elements.push(value("--elements")?),
            "--reps" | "-r" => args.reps = value("--reps")?.max(1),
            "--threads" | "-t" => args.threads = value("--threads")?.max(1),
            "--print" => args.print = true,
            "--help" | "-h" => {
                return Err(
                    "usage: host-kernel-bench [--elements N]... [--reps R] [--threads T] [--print]"
                        .into(),
                )
            }
            other => return Err(format!("unknown argument `{other}` (try --help)")),
        }
    }
    if args.elements.is_empty() {
        args.elements = vec![16 << 20, 64 << 20];
    }
    Ok(args)
}

/// xorshift64* values in roughly N(0, scale)-ish spread, deterministic.
fn fill(x: &mut [f32], seed: u64, scale: f32, positive: bool) {
    let mut s = seed | 1;
    for e in x.iter_mut() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let u = ((s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32) / (1u64 << 24) as f32;
        let v = (u - 0.5) * 2.0 * scale;
        *e = if positive { v * v } else { v };
    }
}

struct State {
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

fn median_ms(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// The two variants of one AdamW step.
#[derive(Clone, Copy)]
enum Variant {
    /// The kernel generated from the AdamW update rule.
    Generated,
    /// The rustc-compiled loop.
    Reference,
}

fn run(n: usize, args: &Args, kernel: &AdamWKernel, c: &AdamWConstants) -> Result<bool, String> {
    let mut grad = vec![0f32; n];
    fill(&mut grad, 0x9e37_79b9_7f4a_7c15 ^ n as u64, 1e-2, false);
    let mut a = State {
        p: vec![0f32; n],
        m: vec![0f32; n],
        v: vec![0f32; n],
    };
    fill(&mut a.p, 1, 0.1, false);
    fill(&mut a.m, 2, 1e-3, false);
    fill(&mut a.v, 3, 1e-3, true);
    let copy = |s: &State| State {
        p: s.p.clone(),
        m: s.m.clone(),
        v: s.v.clone(),
    };
    let mut states = [copy(&a), a];
    let lr = 3e-4;
    let variants = [Variant::Generated, Variant::Reference];
    let mut times: [Vec<f64>; 2] = Default::default();
    for t in 1..=(args.reps as u64 + 1) {
        // After every step the copies are bit-identical again (both variants compute the same
        // step), so the variants trade copies: where an array sits in memory (pages, huge
        // pages) changes streaming bandwidth by ~10% at 64M elements, and trading spreads
        // that over both. The order alternates too.
        for k in 0..2 {
            let which = (k + t as usize) % 2;
            let s = &mut states[(which + t as usize / 2) % 2];
            let t0 = Instant::now();
            match variants[which] {
                Variant::Generated => kernel
                    .update(t, lr, &mut s.p, &grad, &mut s.m, &mut s.v)
                    .map_err(|e| e.to_string())?,
                Variant::Reference => {
                    adamw_reference(c, t, lr, &mut s.p, &grad, &mut s.m, &mut s.v)
                        .map_err(|e| e.to_string())?
                }
            }
            if t > 1 {
                times[which].push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    let same = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(x, y)| x.to_bits() == y.to_bits());
    let eq = |x: &State, y: &State| same(&x.p, &y.p) && same(&x.m, &y.m) && same(&x.v, &y.v);
    let identical = eq(&states[0], &states[1]);
    let [mut gen, mut reference] = times;
    let (gm, rm) = (median_ms(&mut gen), median_ms(&mut reference));
    let bytes = 28.0 * n as f64;
    let gbs = |ms: f64| bytes / (ms * 1e-3) / 1e9;
    println!(
        "{:>11} {:>7} {:>9.3} {:>8.2} {:>9.3} {:>8.2} {:>9.3} {:>10}",
        n,
        args.threads,
        gm,
        gbs(gm),
        rm,
        gbs(rm),
        rm / gm,
        if identical { "yes" } else { "NO" }
    );
    Ok(identical)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let c = AdamWConstants {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let t0 = Instant::now();
    let kernel = match AdamWKernel::compile(&c) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("compile: {e}");
            return ExitCode::FAILURE;
        }
    };
    let compile_ms = t0.elapsed().as_secs_f64() * 1e3;
    if args.print {
        println!(
            "; generated CLIF\n{}\n; optimized CLIF\n{}\n; machine code\n{}",
            kernel.ir_text(),
            kernel.optimized_ir_text(),
            kernel.disasm_text()
        );
    }
    println!(
        "AdamW f32 {c:?}; kernel generated from the rule and compiled in {compile_ms:.2} ms; {} timed reps (median), 28 B/element; gen/ref = throughput over the rustc loop's",
        args.reps
    );
    println!(
        "{:>11} {:>7} {:>9} {:>8} {:>9} {:>8} {:>9} {:>10}",
        "elements", "threads", "gen_ms", "gen_GB/s", "ref_ms", "ref_GB/s", "gen/ref", "bit-equal"
    );
    let pool = match rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads)
        .build()
    {
        Ok(p) => p,
        Err(e) => {
            eprintln!("rayon pool of {} threads: {e}", args.threads);
            return ExitCode::FAILURE;
        }
    };
    let mut ok = true;
    for &n in &args.elements {
        match pool.install(|| run(n, &args, &kernel, &c)) {
            Ok(identical) => ok &= identical,
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        eprintln!("the kernel's and the reference's results differ");
        ExitCode::FAILURE
    }
}
