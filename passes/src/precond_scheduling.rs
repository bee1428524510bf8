//! `precond-scheduling`: for every Kronecker factor's eigenbasis refresh, decides **where** it
//! runs (host worker pool or GPU side stream), **when** (its offset within the refresh period,
//! staggering factors so that no step carries them all) and **how stale** its result may be
//! (the spec's `staleness` S; S = 0 keeps the native, synchronous schedule).
//!
//! The decisions come from the cost model ([`crate::cost_model`]) of the target: per factor of
//! size d, the host refresh costs `host_qr(d)` of one pool core (one refresh per core, plus the
//! staging copies on a discrete GPU in its latency) and is invisible to the step when it
//! finishes within S steps — queueing behind the refreshes launched at the same step included —
//! and the pool is not oversubscribed over a period; a GPU side-stream refresh costs
//! `gpu_qr(d)`, of which the
//! `side_stream_interference` fraction shows up in the step. With S = 0 every refresh is
//! visible and the faster place wins. Largest factors are placed first (LPT), and offsets
//! balance the per-step load of each place (Paper §3.2: off-critical-path preconditioner work).
//!
//! Shampoo's refreshes (method `inverse_root`) are placed the same way with their own costs:
//! `host_inverse_root_ms(d)` on a pool core, `gpu_inverse_root_ms(d)` (cuSOLVER `syevd` plus a
//! `2d³` GEMM) on the side stream. Hundreds of them per period (blocks of 1024) overload both
//! places, so once the side stream's work exceeds the period as well, each further refresh goes
//! where the period's overrun grows least — the pool's excess over its share of the period,
//! divided among its threads, against the side stream's excess — and the two places' throughput
//! adds up; nor does a host refresh that would miss the staleness bound move to a side stream
//! that is full already. SOAP and KL-Shampoo refreshes, which never fill the side stream, are
//! placed as before.
use crate::cost_model::TargetDescription;
use crate::{Pass, PassContext, PassError};
use ir::config::TargetConfig;
use ir::{InstId, Module, Op, Placement, RefreshPlacement, Section};
use std::fmt::Write;

/// Share of the host pool's time per period that refreshes may fill (the rest is left to the
/// engine's own host work).
pub const HOST_HEADROOM: f64 = 0.8;

/// One refresh decision, as reported by `--print-after precond-scheduling`.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The `eigenbasis_refresh` instruction.
    pub inst: InstId,
    /// Factor name (`%h0.attn.c_attn.weight.L`).
    pub factor: String,
    /// Factor size d (the factor is `d × d`).
    pub dim: usize,
    /// Chosen place.
    pub placement: Placement,
    /// Offset within the period.
    pub offset: u64,
    /// Predicted host refresh time, ms (incl. staging copies).
    pub host_ms: f64,
    /// Predicted GPU side-stream refresh time, ms (`None` without GPU).
    pub gpu_ms: Option<f64>,
    /// Predicted time this refresh adds to the steps of one period, ms.
    pub visible_ms: f64,
}

/// The pass's result: the target description used and every decision.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Schedule {
    /// Description name.
    pub target: String,
    /// Staleness bound S.
    pub staleness: u32,
    /// Predicted training-step time without refreshes, ms.
    pub step_ms: f64,
    /// Decisions in program order.
    pub decisions: Vec<Decision>,
}

impl Schedule {
    /// Predicted refresh time visible per step, averaged over a period, ms.
    pub fn visible_ms_per_step(&self, frequency: u64) -> f64 {
        self.decisions.iter().map(|d| d.visible_ms).sum::<f64>() / frequency.max(1) as f64
    }
    /// Share of refreshes placed on the host.
    pub fn host_share(&self) -> f64 {
        let host = self
            .decisions
            .iter()
            .filter(|d| d.placement == Placement::Host)
            .count();
        host as f64 / self.decisions.len().max(1) as f64
    }
}

/// Loads the target description named by the spec (a built-in or a calibration file); the
/// default is `cpu` for a CPU target and `h200` for CUDA.
pub fn target_description(target: &TargetConfig) -> Result<TargetDescription, PassError> {
    let name = target.calibration().unwrap_or(match target {
        TargetConfig::Cpu { .. } => "cpu",
        TargetConfig::Cuda { .. } => "h200",
    });
    if let Some(d) = TargetDescription::builtin(name) {
        return Ok(d);
    }
    let bad = |m: String| PassError::Invalid {
        pass: "precond-scheduling",
        message: m,
    };
    let text = std::fs::read_to_string(name)
        .map_err(|e| bad(format!("cannot read calibration file {name}: {e}")))?;
    let desc: TargetDescription = serde_json::from_str(&text).map_err(|e| {
        bad(format!(
            "calibration file {name} is not a target description: {e}"
        ))
    })?;
    desc.validate()
        .map_err(|e| bad(format!("calibration file {name}: {e}")))?;
    Ok(desc)
}

/// Computes the decisions for `module` on `desc` without changing the module.
pub fn plan_refreshes(module: &Module, desc: &TargetDescription) -> Schedule {
    let staleness = module.config.target.staleness();
    let params: usize = module
        .parameters()
        .into_iter()
        .map(|v| module.value(v).ty.numel())
        .sum();
    // Every micro-batch of the step (`grad_accum`) runs the forward and backward.
    let tokens = module.config.data.batch_size
        * module.config.data.seq_len
        * module.config.train.grad_accum.max(1) as usize;
    let step_ms = desc.predicted_step_ms(params, tokens).max(1e-3);
    // (instruction, d, frequency, factor name, method `inverse_root`: Shampoo's inverse root,
    // with its own costs).
    let items: Vec<(InstId, usize, u64, String, bool)> = module
        .section(Section::Refresh)
        .filter_map(|i| match module.inst(i).op {
            Op::EigenbasisRefresh {
                frequency, method, ..
            } => {
                let f = module.inst(i).args[0];
                Some((
                    i,
                    module.value(f).ty.shape[0],
                    frequency,
                    module.display_value(f),
                    method == ir::RefreshMethod::InverseRoot,
                ))
            }
            _ => None,
        })
        .collect();
    let frequency = items.iter().map(|x| x.2).max().unwrap_or(1).max(1);
    // Host-pool time available per period (core-ms): every pool thread runs one refresh at a
    // time, single-threaded; HOST_HEADROOM of it, since the engine's own host work (data,
    // launches, swaps) shares the cores.
    let host_capacity =
        HOST_HEADROOM * desc.host_pool_threads() as f64 * frequency as f64 * step_ms;
    // A host result must land within S steps.
    let latency_budget = staleness as f64 * step_ms;
    // 1. Placement. With S = 0 the faster place wins. Otherwise host work is free while it fits
    // the pool's time per period and meets the latency budget; the GPU side stream costs its
    // interference. Fill the host in order of "visible GPU time saved per host ms" (a greedy
    // knapsack), ties by size, so cheap small factors move to the host first.
    // Once the side stream's work exceeds the period, further refreshes go where the period's
    // overrun grows least (see the module docs).
    let cost = |i: usize| {
        let (dim, root) = (items[i].1, items[i].4);
        if root {
            (
                desc.host_inverse_root_ms(dim),
                desc.gpu_inverse_root_ms(dim),
            )
        } else {
            (
                desc.host_refresh_ms(dim, false),
                desc.gpu_refresh_ms(dim, false),
            )
        }
    };
    let threads = desc.host_pool_threads() as f64;
    // Side-stream time per period (ms) before its work overruns the period.
    let period_ms = frequency as f64 * step_ms;
    // The period's overrun with `host` core-ms on the pool and `gpu` ms on the side stream:
    // the later of the two places' excess over their share of the period.
    let overrun = |host: f64, gpu: f64| {
        ((host - host_capacity).max(0.0) / threads).max((gpu - period_ms).max(0.0))
    };
    let mut order: Vec<usize> = (0..items.len()).collect();
    let density = |i: usize| {
        let (h, g) = cost(i);
        g.map_or(f64::INFINITY, |g| {
            g * desc.side_stream_interference / h.max(1e-9)
        })
    };
    order.sort_by(|&a, &b| {
        density(b)
            .total_cmp(&density(a))
            .then(items[b].1.cmp(&items[a].1))
    });
    let mut placement = vec![Placement::Host; items.len()];
    let mut visible = vec![0.0f64; items.len()];
    let (mut host_load, mut gpu_load) = (0.0, 0.0);
    // The spec's `refresh_placement` (CPU targets: always the host) overrides the cost model.
    let forced = module.config.target.refresh_placement();
    for i in order {
        let (host_ms, gpu_ms) = cost(i);
        // Pool (core) time only: the staging copies run on the copy streams.
        let pool_ms = host_ms - desc.transfer_ms(items[i].1);
        let gpu_ms = match forced {
            RefreshPlacement::Host => None,
            RefreshPlacement::Gpu => Some(gpu_ms.unwrap_or(host_ms)),
            RefreshPlacement::Auto => gpu_ms,
        };
        let (p, v) = match gpu_ms {
            Some(g) if forced == RefreshPlacement::Gpu => (
                Placement::GpuSide,
                if staleness == 0 {
                    g
                } else {
                    g * desc.side_stream_interference
                },
            ),
            None => {
                // No GPU: everything on the host; what exceeds the pool's time shows up.
                let over = if staleness == 0 {
                    host_ms
                } else {
                    (host_load + host_ms - host_capacity).clamp(0.0, host_ms)
                };
                (Placement::Host, over)
            }
            Some(g) if staleness == 0 => {
                if host_ms <= g {
                    (Placement::Host, host_ms)
                } else {
                    (Placement::GpuSide, g)
                }
            }
            Some(g) => {
                if host_ms <= latency_budget && host_load + host_ms <= host_capacity {
                    (Placement::Host, 0.0)
                } else if gpu_load + g <= period_ms {
                    (Placement::GpuSide, g * desc.side_stream_interference)
                } else {
                    // Both places full: the smaller growth of the period's overrun (plus, on
                    // the side stream, the interference of what still fits the period).
                    let now = overrun(host_load, gpu_load);
                    let on_host = overrun(host_load + pool_ms, gpu_load) - now;
                    let on_gpu = overrun(host_load, gpu_load + g) - now
                        + desc.side_stream_interference * (period_ms - gpu_load).clamp(0.0, g);
                    if on_host < on_gpu {
                        (Placement::Host, on_host)
                    } else {
                        (Placement::GpuSide, on_gpu)
                    }
                }
            }
        };
        if p == Placement::Host {
            host_load += pool_ms;
        } else {
            gpu_load += gpu_ms.unwrap_or(host_ms);
        }
        placement[i] = p;
        visible[i] = v;
    }
    // 2. Offsets (S > 0): largest first into the least-loaded step of the period, per place.
    let mut by_size: Vec<usize> = (0..items.len()).collect();
    by_size.sort_by(|&a, &b| items[b].1.cmp(&items[a].1));
    // One slot per step of the period; with n refreshes at most n slots are ever filled and
    // `least` picks the first least-loaded one, so n slots give the same offsets (and a
    // period of 10^12 steps allocates nothing).
    let slots = usize::try_from(frequency)
        .unwrap_or(usize::MAX)
        .min(items.len().max(1));
    let (mut host_slots, mut gpu_slots) = (vec![0.0f64; slots], vec![0.0f64; slots]);
    let mut offsets = vec![0u64; items.len()];
    if staleness > 0 {
        for i in by_size {
            let (host_ms, gpu_ms) = cost(i);
            let period = usize::try_from(items[i].2).map_or(slots, |p| p.min(slots));
            let least = |slots: &[f64]| {
                (0..period)
                    .min_by(|&a, &b| slots[a].total_cmp(&slots[b]))
                    .unwrap_or(0)
            };
            if placement[i] == Placement::Host {
                // Refreshes launched at the same step queue on the pool: the ones already in
                // this slot take `load / threads` before this one starts. When even the
                // least-loaded slot would miss the staleness bound, the GPU side stream takes
                // it (where there is one).
                let best = least(&host_slots);
                let latency = host_slots[best] / threads + host_ms;
                let gpu_ms = gpu_ms.filter(|_| forced == RefreshPlacement::Auto);
                match gpu_ms {
                    // (Not onto a side stream whose work fills the period already.)
                    Some(g) if latency > latency_budget && gpu_load + g <= period_ms => {
                        placement[i] = Placement::GpuSide;
                        visible[i] = g * desc.side_stream_interference;
                        gpu_load += g;
                    }
                    _ => {
                        host_slots[best] += host_ms;
                        offsets[i] = best as u64;
                        continue;
                    }
                }
            }
            let best = least(&gpu_slots);
            gpu_slots[best] += gpu_ms.unwrap_or(host_ms);
            offsets[i] = best as u64;
        }
    }
    let mut decisions: Vec<Decision> = items
        .iter()
        .enumerate()
        .map(|(i, (inst, dim, _, factor, _))| {
            let (host_ms, gpu_ms) = cost(i);
            Decision {
                inst: *inst,
                factor: factor.clone(),
                dim: *dim,
                placement: placement[i],
                offset: offsets[i],
                host_ms,
                gpu_ms,
                visible_ms: visible[i],
            }
        })
        .collect();
    decisions.sort_by_key(|d| module.section(Section::Refresh).position(|i| i == d.inst));
    Schedule {
        target: desc.name.clone(),
        staleness,
        step_ms,
        decisions,
    }
}

/// The `precond-scheduling` pass.
#[derive(Default)]
pub struct PrecondScheduling {
    last: Option<Schedule>,
}

impl Pass for PrecondScheduling {
    fn name(&self) -> &'static str {
        "precond-scheduling"
    }

    fn run(&mut self, module: &mut Module, _cx: &mut PassContext) -> Result<String, PassError> {
        let desc = target_description(&module.config.target)?;
        let schedule = plan_refreshes(module, &desc);
        for d in &schedule.decisions {
            if let Op::EigenbasisRefresh {
                offset,
                staleness,
                placement,
                ..
            } = module.op_mut(d.inst)
            {
                *offset = d.offset;
                *staleness = schedule.staleness;
                *placement = d.placement;
            }
        }
        let n = schedule.decisions.len();
        let summary = format!(
            "{n} refreshes on `{}`: {:.0}% host, S = {}, predicted step {:.2} ms",
            schedule.target,
            100.0 * schedule.host_share(),
            schedule.staleness,
            schedule.step_ms
        );
        self.last = Some(schedule);
        Ok(summary)
    }

    fn dump_extra(&self, _module: &Module, _cx: &PassContext) -> Option<String> {
        let s = self.last.as_ref()?;
        let mut out = format!(
            "; precond-scheduling on `{}`: staleness S = {}, predicted step {:.3} ms\n\
             ;   factor                                   d  place     offset   host ms    gpu ms  visible ms/period\n",
            s.target, s.staleness, s.step_ms
        );
        for d in &s.decisions {
            let gpu = d.gpu_ms.map_or("-".to_string(), |g| format!("{g:.3}"));
            let _ = writeln!(
                out,
                ";   {:<38} {:>5}  {:<8} {:>6} {:>9.3} {:>9} {:>10.3}",
                d.factor,
                d.dim,
                d.placement.to_string(),
                d.offset,
                d.host_ms,
                gpu,
                d.visible_ms
            );
        }
        let period: f64 = s.decisions.iter().map(|d| d.visible_ms).sum();
        let _ = writeln!(
            out,
            "; predicted visible refresh time per period: {period:.3} ms; host share {:.0}%",
            100.0 * s.host_share()
        );
        Some(out)
    }
}
