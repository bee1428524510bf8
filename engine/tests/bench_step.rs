//! Step-time measurement of the tiny GPT-2-vocabulary model (vocab 50257, d 64, 2 layers,
//! 4 heads, batch 16 × 64 tokens) on 2 threads. Ignored by default (timing, not correctness):
//! `cargo test --release -p asteria-engine --test bench_step -- --ignored --nocapture`.
mod common;

use common::gpt::{plan, Gpt};
use common::rand_ids;
use engine::{CpuEngine, EngineOptions, Rng};
use std::time::Instant;

fn bench(soap: bool) {
    let g = Gpt {
        vocab: 50257,
        ctx: 64,
        d: 64,
        layers: 2,
        heads: 4,
        batch: 16,
        seq: 64,
        soap,
        max_precond_dim: 10000,
        lr: 1e-3,
        threads: Some(2),
    };
    let mut e = CpuEngine::<f32>::new(plan(&g), EngineOptions::default()).expect("plan");
    let mut rng = Rng::new(1);
    let x = rand_ids(&mut rng, g.batch * g.seq, g.vocab);
    let y = rand_ids(&mut rng, g.batch * g.seq, g.vocab);
    let mut phases = [0.0f64; 4];
    let mut steps_ms = vec![];
    for t in 1..=12u64 {
        let t0 = Instant::now();
        e.load_batch(&x, &y).expect("batch");
        e.forward().expect("forward");
        let t1 = Instant::now();
        e.backward().expect("backward");
        let t2 = Instant::now();
        e.optimizer_step(t, 1.0).expect("optimizer");
        let t3 = Instant::now();
        e.run_host_tasks(t).expect("host");
        let t4 = Instant::now();
        if t > 2 {
            for (p, (a, b)) in phases
                .iter_mut()
                .zip([(t0, t1), (t1, t2), (t2, t3), (t3, t4)])
            {
                *p += (b - a).as_secs_f64() * 1e3 / 10.0;
            }
            steps_ms.push((t4 - t0).as_secs_f64() * 1e3);
        }
    }
    steps_ms.sort_by(f64::total_cmp);
    eprintln!(
        "{}: median step {:.1} ms (max {:.1}) | forward {:.1} backward {:.1} optimizer {:.1} host {:.1} ms | {:.0} tok/s",
        if soap { "SOAP " } else { "AdamW" },
        steps_ms[5],
        steps_ms[9],
        phases[0],
        phases[1],
        phases[2],
        phases[3],
        1024.0 / (steps_ms[5] / 1e3)
    );
}

#[test]
#[ignore]
fn tiny_gpt2_vocab_step_time() {
    bench(false);
    bench(true);
}
