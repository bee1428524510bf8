//! `--profile`: the per-op rows the program runner fills ([`ProfileRows`]), the shape
//! suffix of a row's key, the event timeline of `--profile events` and the printed table.
use super::CudaEngine;
use cudarc::driver::CudaEvent;
use schedule::Op;

/// `--profile` state: per `section/op[ shape]` the calls, GPU ms and host ms.
pub(super) struct ProfileRows {
    /// CUDA events around each op instead of host syncs (`--profile events`).
    pub(super) events: bool,
    /// Whether the first optimizer step has run: ops are timed from the second training
    /// step on (the first, and the evaluation before it, load modules and plan GEMMs).
    pub(super) warm: bool,
    pub(super) rows: std::collections::BTreeMap<String, (u64, f64, f64)>,
}

impl CudaEngine {
    /// The per-op table of `--profile` (training steps from the second on, and the
    /// evaluations after the first step), largest GPU time first; empty without it.
    /// `--profile ops`: every op is synchronized before and after, so "GPU ms" is
    /// its wall time including launch overhead (slower steps). `--profile events`:
    /// no host syncs inside a program; CUDA events on the compute stream around each op give
    /// its GPU time, "host ms" the time the engine thread spent enqueueing it, and a
    /// `SECTION/(GPU idle)` row per program the time the compute stream sat idle between its
    /// ops (waiting for the host to enqueue them).
    pub fn profile_table(&self) -> String {
        let Some(p) = &self.profile else {
            return String::new();
        };
        let mut rows: Vec<_> = p.rows.iter().collect();
        rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        let total: f64 = rows.iter().map(|r| r.1 .1).sum();
        let mut s = String::from(
            "| op (section/name) | calls | GPU ms | host ms | share |\n|---|---|---|---|---|\n",
        );
        for (k, (n, ms, host)) in rows {
            s += &format!(
                "| {k} | {n} | {ms:.1} | {host:.1} | {:.1}% |\n",
                100.0 * ms / total.max(1e-9)
            );
        }
        s += &format!("| total | | {total:.1} | | |\n");
        s
    }

    /// Optimizer ops are profiled per parameter shape (` 768x3072`), GEMMs per operand shapes
    /// and transposes (` 16384x768·768x2304ᵀ`), others by name only.
    pub(super) fn profile_shape(&self, op: &Op) -> String {
        match op {
            Op::MatMul {
                a,
                b,
                trans_a,
                trans_b,
                ..
            } => {
                let (ar, ac) = self.dims(*a);
                let (br, bc) = self.dims(*b);
                let t = |x: bool| if x { "ᵀ" } else { "" };
                format!(" {ar}x{ac}{}·{br}x{bc}{}", t(*trans_a), t(*trans_b))
            }
            Op::MatMulBias {
                a,
                b,
                trans_a,
                trans_b,
                ..
            } => {
                let (ar, ac) = self.dims(*a);
                let (br, bc) = self.dims(*b);
                let t = |x: bool| if x { "ᵀ" } else { "" };
                format!(" {ar}x{ac}{}·{br}x{bc}{} +bias", t(*trans_a), t(*trans_b))
            }
            Op::SoapUpdate { grad, .. }
            | Op::SoapFactorUpdate { grad, .. }
            | Op::KlShampooUpdate { grad, .. }
            | Op::ShampooUpdate { grad, .. } => {
                let shape: Vec<String> = self
                    .plan
                    .buffer(*grad)
                    .shape
                    .iter()
                    .map(|d| d.to_string())
                    .collect();
                format!(" {}", shape.join("x"))
            }
            _ => String::new(),
        }
    }

    /// Waits for the program's events and adds each op's GPU time, and the compute stream's
    /// idle time between the first and the last op, to the profile.
    pub(super) fn profile_timeline(
        &mut self,
        section: &str,
        timeline: &[(String, CudaEvent, CudaEvent, f64)],
    ) {
        let (Some(first), Some(last)) = (timeline.first(), timeline.last()) else {
            return;
        };
        if last.2.synchronize().is_err() {
            return;
        }
        let Some(p) = self.profile.as_mut() else {
            return;
        };
        let mut busy = 0.0f64;
        for (key, ev0, ev1, host_ms) in timeline {
            let ms = ev0.elapsed_ms(ev1).unwrap_or(0.0) as f64;
            busy += ms;
            let e = p.rows.entry(key.clone()).or_insert((0, 0.0, 0.0));
            e.0 += 1;
            e.1 += ms;
            e.2 += host_ms;
        }
        let span = first.1.elapsed_ms(&last.2).unwrap_or(0.0) as f64;
        let e = p
            .rows
            .entry(format!("{section}/(GPU idle)"))
            .or_insert((0, 0.0, 0.0));
        e.0 += 1;
        e.1 += (span - busy).max(0.0);
    }
}
