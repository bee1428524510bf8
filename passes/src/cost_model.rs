//! The cost model behind `precond-scheduling`: a description of the execution target (host
//! cores, host↔GPU link, measured eigensolve and power-iteration+QR times per matrix size,
//! training-step time) and the predicted cost of refreshing one Kronecker factor on the host
//! worker pool or on the GPU side stream.
//!
//! Descriptions are JSON files written by `asteria calibrate` (measured on the machine) or one
//! of the built-ins: `h200` (the anchors in DESIGN.md, measured on an H200 PCIe host), `gh200`
//! and `gb10` (simulated unified-memory Grace/Blackwell systems: NVLink-C2C or shared LPDDR5x,
//! no staging copies, strong Arm hosts — numbers estimated, not measured), and `cpu`
//! (a 2-core host without GPU, the CI machine).
use serde::{Deserialize, Serialize};

/// Measured (or estimated) performance of one execution target. Times are wall-clock
/// milliseconds for fp32 matrices; sizes are matrix dimensions `n` of `n × n` factors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TargetDescription {
    /// Name (`h200`, `gh200`, `cpu`, or the calibrated host's).
    pub name: String,
    /// Host cores available to the refresh worker pool.
    pub host_cores: usize,
    /// Host↔GPU bandwidth each way in GB/s (pinned memory); `None` = no GPU.
    pub host_gpu_gbps: Option<f64>,
    /// CPU and GPU share memory (GH200 / GB10): no staging copies for host refreshes.
    pub unified_memory: bool,
    /// Host `eigh` (values + vectors) time per size, all pool cores: `(n, ms)`, ascending n.
    pub host_eigh_ms: Vec<(usize, f64)>,
    /// Host refresh time (one power iteration `F·Q` + thin QR + the `diag(QᵀFQ)` sort) per size.
    pub host_qr_ms: Vec<(usize, f64)>,
    /// GPU `syevd` time per size (empty without a GPU).
    pub gpu_eigh_ms: Vec<(usize, f64)>,
    /// GPU power iteration + QR time per size (empty without a GPU).
    pub gpu_qr_ms: Vec<(usize, f64)>,
    /// Effective training throughput in TFLOP/s (6·params·tokens per step), used to predict the
    /// step time when the spec does not give one.
    pub train_tflops: f64,
    /// Fraction of GPU side-stream time that shows up in the step time (the side stream
    /// competes with the compute stream for SMs).
    pub side_stream_interference: f64,
}

/// Linear interpolation in log-log space; beyond the measured range, `n³` scaling from the
/// nearest point. `None` when `table` is empty.
pub fn interpolate(table: &[(usize, f64)], n: usize) -> Option<f64> {
    let (first, last) = (table.first()?, table.last()?);
    let cube = |from: &(usize, f64)| from.1 * (n as f64 / from.0 as f64).powi(3);
    if n <= first.0 {
        return Some(cube(first));
    }
    if n >= last.0 {
        return Some(cube(last));
    }
    let w = table.windows(2).find(|w| n >= w[0].0 && n <= w[1].0)?;
    let (x0, y0, x1, y1) = (
        (w[0].0 as f64).ln(),
        w[0].1.ln(),
        (w[1].0 as f64).ln(),
        w[1].1.ln(),
    );
    let t = ((n as f64).ln() - x0) / (x1 - x0);
    Some((y0 + t * (y1 - y0)).exp())
}

impl TargetDescription {
    /// A built-in description by name: `h200`, `gh200`, `gb10`, `cpu`.
    pub fn builtin(name: &str) -> Option<TargetDescription> {
        // DESIGN.md anchors (H200 PCIe host, 16 cores, 2026-11-30).
        let h200_gpu_eigh = vec![(768, 7.9), (2048, 24.8), (4096, 88.6)];
        let h200_gpu_qr = vec![(768, 3.2), (2048, 10.8), (4096, 29.1)];
        let h200_host_eigh = vec![(768, 61.0), (2048, 523.0), (4096, 2973.0)];
        let scale =
            |t: &[(usize, f64)], s: f64| t.iter().map(|&(n, ms)| (n, ms * s)).collect::<Vec<_>>();
        Some(match name {
            "h200" => TargetDescription {
                name: "h200".into(),
                host_cores: 16,
                host_gpu_gbps: Some(55.0),
                unified_memory: false,
                host_qr_ms: scale(&h200_host_eigh, 0.35),
                host_eigh_ms: h200_host_eigh,
                gpu_eigh_ms: h200_gpu_eigh,
                gpu_qr_ms: h200_gpu_qr,
                // PyTorch eager's rate. asteria's own engine reaches 73 TFLOP/s on GPT-2 124M;
                // with that step time the pass moves 64 of 99 GPT-2 refreshes to the host pool
                // and the H200 measured a lower mean step (1.30× vs 1.37× AdamW) but waits at
                // the staleness bound (max/median 1.28 vs 1.07): the host QR table below
                // underestimates refreshes that share the pool with each other and the engine
                // (BENCHMARKS.md, call 6). Kept until the host table is calibrated in-engine.
                train_tflops: 280.0,
                side_stream_interference: 0.6,
            },
            // Simulated: 72 Neoverse V2 cores (~4x the x86 host's eigh rate), NVLink-C2C
            // 450 GB/s with coherent unified memory, an H100-class GPU.
            "gh200" => TargetDescription {
                name: "gh200".into(),
                host_cores: 72,
                host_gpu_gbps: Some(450.0),
                unified_memory: true,
                host_eigh_ms: scale(&h200_host_eigh, 0.25),
                host_qr_ms: scale(&h200_host_eigh, 0.25 * 0.35),
                gpu_eigh_ms: scale(&h200_gpu_eigh, 1.1),
                gpu_qr_ms: scale(&h200_gpu_qr, 1.1),
                train_tflops: 250.0,
                side_stream_interference: 0.6,
            },
            // Simulated: 20 Arm cores, one LPDDR5x pool shared with a GPU ~1/8 of an H200.
            "gb10" => TargetDescription {
                name: "gb10".into(),
                host_cores: 20,
                host_gpu_gbps: Some(273.0),
                unified_memory: true,
                host_eigh_ms: scale(&h200_host_eigh, 0.8),
                host_qr_ms: scale(&h200_host_eigh, 0.8 * 0.35),
                gpu_eigh_ms: scale(&h200_gpu_eigh, 8.0),
                gpu_qr_ms: scale(&h200_gpu_qr, 8.0),
                train_tflops: 35.0,
                side_stream_interference: 0.8,
            },
            // A 2-core CI-class host without GPU (measured on the development machine with
            // `asteria calibrate`, rounded).
            "cpu" => TargetDescription {
                name: "cpu".into(),
                host_cores: 2,
                host_gpu_gbps: None,
                unified_memory: false,
                host_eigh_ms: vec![(64, 0.5), (256, 12.0), (1024, 420.0)],
                host_qr_ms: vec![(64, 0.2), (256, 4.0), (1024, 150.0)],
                gpu_eigh_ms: vec![],
                gpu_qr_ms: vec![],
                train_tflops: 0.06,
                side_stream_interference: 0.0,
            },
            _ => return None,
        })
    }

    /// Names of the built-in descriptions.
    pub const BUILTINS: [&'static str; 4] = ["h200", "gh200", "gb10", "cpu"];

    /// Whether the target has a GPU side stream to refresh on.
    pub fn has_gpu(&self) -> bool {
        self.host_gpu_gbps.is_some() && !self.gpu_qr_ms.is_empty()
    }

    /// Host refresh of an `n × n` factor, ms: the power iteration + QR (or `eigh` for the first
    /// basis), plus on a discrete GPU the copies (factor down, basis up) over the host link.
    pub fn host_refresh_ms(&self, n: usize, first: bool) -> f64 {
        let table = if first {
            &self.host_eigh_ms
        } else {
            &self.host_qr_ms
        };
        let compute = interpolate(table, n).unwrap_or(f64::INFINITY);
        compute + self.transfer_ms(n)
    }

    /// Staging copies of one refresh on a discrete GPU (factor D2H + basis H2D), ms.
    pub fn transfer_ms(&self, n: usize) -> f64 {
        match (self.host_gpu_gbps, self.unified_memory) {
            (Some(gbps), false) => 2.0 * (n * n * 4) as f64 / (gbps * 1e6),
            _ => 0.0,
        }
    }

    /// GPU side-stream refresh of an `n × n` factor, ms (`None` without a GPU).
    pub fn gpu_refresh_ms(&self, n: usize, first: bool) -> Option<f64> {
        let table = if first {
            &self.gpu_eigh_ms
        } else {
            &self.gpu_qr_ms
        };
        if !self.has_gpu() {
            return None;
        }
        interpolate(table, n)
    }

    /// Predicted step time (ms) of a model with `params` parameters and `tokens` per step.
    pub fn predicted_step_ms(&self, params: usize, tokens: usize) -> f64 {
        6.0 * params as f64 * tokens as f64 / (self.train_tflops * 1e9)
    }
}
