//! The cost model behind `precond-scheduling`: a description of the execution target (host
//! cores, host↔GPU link, measured eigensolve and power-iteration+QR times per matrix size,
//! training-step time) and the predicted cost of refreshing one Kronecker factor (an
//! eigenbasis, or Shampoo's inverse root) on the host worker pool or on the GPU side stream.
//!
//! Descriptions are JSON files written by `asteria calibrate` (measured on the machine) or one
//! of the built-ins: `h200` (measured on the H200 host with `asteria calibrate`), `gh200`
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
    /// Host refresh time (one power iteration `F·Q` + thin QR + the `diag(QᵀFQ)` sort) per
    /// size, **on one core while every pool core runs one**: the engines run asynchronous host
    /// refreshes one per pool thread, single-threaded (`optim::with_sequential`), which is how
    /// `asteria calibrate` measures it.
    pub host_qr_ms: Vec<(usize, f64)>,
    /// GPU `syevd` time per size (empty without a GPU).
    pub gpu_eigh_ms: Vec<(usize, f64)>,
    /// GPU power iteration + QR time per size (empty without a GPU).
    pub gpu_qr_ms: Vec<(usize, f64)>,
    /// Host inverse root (Shampoo: `eigh` + `Q diag(w) Qᵀ`) per size, **on one core while
    /// every pool core runs one**, `(n, ms)`; empty: the QR refresh's `host_qr_ms` stands in.
    #[serde(default)]
    pub host_inverse_root_ms: Vec<(usize, f64)>,
    /// fp32 (non-tensor-core) GEMM rate of the GPU in TFLOP/s, for the `2n³` GEMM of a GPU
    /// inverse root (`None`: not counted, beside the `syevd` it is small).
    #[serde(default)]
    pub gpu_fp32_tflops: Option<f64>,
    /// Effective training throughput in TFLOP/s (6·params·tokens per step), used to predict the
    /// step time when the spec does not give one.
    pub train_tflops: f64,
    /// Fraction of GPU side-stream time that shows up in the step time (the side stream
    /// competes with the compute stream for SMs).
    pub side_stream_interference: f64,
    /// Sequential read bandwidth of the NVMe tier's drive, GB/s (`None`: unknown, the
    /// `tier-placement` pass assumes 1 GB/s).
    #[serde(default)]
    pub nvme_read_gbps: Option<f64>,
    /// Sequential write bandwidth of the NVMe tier's drive, GB/s.
    #[serde(default)]
    pub nvme_write_gbps: Option<f64>,
    /// Throughput of the host AdamW kernel on every host core, GB/s of optimizer state
    /// (28 bytes per element: parameter, gradient and both moments read, three of them
    /// written), for `host_updates` (`None`: not measured; `asteria calibrate` measures it).
    #[serde(default)]
    pub host_update_gbps: Option<f64>,
    /// The device's memory in bytes, as the driver reports its total (`cuMemGetInfo`); on a
    /// unified-memory target the pool the CPU and GPU share. `None`: unknown. Without a
    /// `gpu_memory` budget nothing is placed by it; `tier-placement` and `asteria explain` only
    /// warn when a plan needs more than this.
    #[serde(default)]
    pub device_memory_bytes: Option<u64>,
}

/// Bytes of state one AdamW update touches per element (f32 parameter, gradient, two
/// moments read; parameter and moments written).
pub const ADAMW_BYTES_PER_ELEMENT: usize = 28;

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
    /// Checks a description read from a file before a pass predicts anything with it: at least
    /// one host core; every rate (GB/s, TFLOP/s) positive and finite; every time table's sizes
    /// positive and ascending and its times positive and finite; the host tables (`eigh`,
    /// QR) not empty; the side-stream interference in `[0, 1]`.
    ///
    /// # Errors
    /// The first field that is out of range, by name, with the allowed range.
    pub fn validate(&self) -> Result<(), String> {
        if self.host_cores == 0 {
            return Err("host_cores = 0: at least one host core (1 or more)".into());
        }
        let rate = |name: &str, v: Option<f64>| match v {
            Some(x) if !(x.is_finite() && x > 0.0) => {
                Err(format!("{name} = {x}: a positive, finite rate"))
            }
            _ => Ok(()),
        };
        rate("host_gpu_gbps", self.host_gpu_gbps)?;
        rate("gpu_fp32_tflops", self.gpu_fp32_tflops)?;
        rate("train_tflops", Some(self.train_tflops))?;
        rate("nvme_read_gbps", self.nvme_read_gbps)?;
        rate("nvme_write_gbps", self.nvme_write_gbps)?;
        rate("host_update_gbps", self.host_update_gbps)?;
        if self.device_memory_bytes == Some(0) {
            return Err("device_memory_bytes = 0: the device's memory in bytes (1 or more)".into());
        }
        if !(0.0..=1.0).contains(&self.side_stream_interference) {
            return Err(format!(
                "side_stream_interference = {}: a fraction in [0, 1]",
                self.side_stream_interference
            ));
        }
        let tables: [(&str, &[(usize, f64)], bool); 5] = [
            ("host_eigh_ms", &self.host_eigh_ms, true),
            ("host_qr_ms", &self.host_qr_ms, true),
            ("gpu_eigh_ms", &self.gpu_eigh_ms, false),
            ("gpu_qr_ms", &self.gpu_qr_ms, false),
            ("host_inverse_root_ms", &self.host_inverse_root_ms, false),
        ];
        for (name, t, required) in tables {
            if required && t.is_empty() {
                return Err(format!(
                    "{name} is empty: at least one (size, ms) measurement"
                ));
            }
            for (i, &(n, ms)) in t.iter().enumerate() {
                if n == 0 || !(ms.is_finite() && ms > 0.0) {
                    return Err(format!(
                        "{name}[{i}] = ({n}, {ms}): a size of 1 or more and a positive, finite time"
                    ));
                }
                if i > 0 && n <= t[i - 1].0 {
                    return Err(format!(
                        "{name}: sizes must ascend ({} then {n})",
                        t[i - 1].0
                    ));
                }
            }
        }
        Ok(())
    }

    /// A built-in description by name: `h200`, `gh200`, `gb10`, `cpu`.
    pub fn builtin(name: &str) -> Option<TargetDescription> {
        // Measured on the H200 host (16 cores, driver 580) with `asteria calibrate --device
        // cuda --sizes 768,1024,2304,3072` (rounded): host QR times are one refresh per core
        // with all 16 cores busy (how the engines run them), GPU times through the engine's
        // refresher, whose QR is the Rayleigh–Cholesky QR on the tensor cores (1024
        // interpolated; Householder QR, its fallback, takes 3.3 / 4.7 / 13.7 / 20.6 ms).
        let h200_gpu_eigh = vec![(768, 7.7), (1024, 10.6), (2304, 31.6), (3072, 50.9)];
        let h200_gpu_qr = vec![(768, 1.34), (2304, 4.98), (3072, 8.08)];
        let h200_host_eigh = vec![(768, 55.7), (1024, 107.0), (2304, 660.0), (3072, 1076.0)];
        let h200_host_qr = vec![(768, 65.0), (1024, 163.0), (2304, 1302.0), (3072, 4056.0)];
        let scale =
            |t: &[(usize, f64)], s: f64| t.iter().map(|&(n, ms)| (n, ms * s)).collect::<Vec<_>>();
        Some(match name {
            "h200" => TargetDescription {
                name: "h200".into(),
                host_cores: 16,
                host_gpu_gbps: Some(55.4),
                unified_memory: false,
                host_eigh_ms: h200_host_eigh,
                host_qr_ms: h200_host_qr,
                gpu_eigh_ms: h200_gpu_eigh,
                gpu_qr_ms: h200_gpu_qr,
                // Derived from the Shampoo S=5 runs on the H200 (BENCHMARKS.md, "KL-Shampoo and
                // Shampoo on the H200"), where the step waited for the 14 pool threads: 1.44B
                // (2,846 of its 2,898 roots at 1024) 2,216 ms per step over AdamW's, 124M
                // (206 at 1024, 257 at 768) 245 ms: 107–109 ms per root per core at 1024.
                host_inverse_root_ms: vec![(1024, 108.0)],
                // Estimated from the H200's fp32 peak (67 TFLOP/s), not measured.
                gpu_fp32_tflops: Some(50.0),
                // asteria's CUDA engine on GPT-2 124M at batch 16×1024: 52 ms per AdamW step
                // (BENCHMARKS.md; 6·124M·16384 flop / 52 ms). The pass keeps the 2304/3072
                // factors on the side stream and moves the 768/1024 ones to the host pool
                // (measured: mean step 1.285x AdamW against 1.419x with every refresh on the
                // side stream).
                train_tflops: 235.0,
                // Measured: the 36 side-stream refreshes per period (24 × 8.08 + 12 × 4.98 ≈
                // 254 ms of GPU time) add 213 ms per period to S=5 against S=0's median step
                // (80.3 against 59.0 ms): 0.84.
                side_stream_interference: 0.84,
                // Estimated (a data-center PCIe 4 NVMe drive), not measured.
                nvme_read_gbps: Some(3.0),
                nvme_write_gbps: Some(2.5),
                // `asteria calibrate --device cuda` on the lending pool's H100 machine (16
                // cores, 128 GiB, the H200 machine's host shape), 2026-12-05: the Cranelift
                // AdamW kernel with 16 threads, 2.95 ms per 16M elements (BENCHMARKS.md).
                host_update_gbps: Some(159.0),
                // The driver's total on the H200 (`cuMemGetInfo`, 139.8 GiB; BENCHMARKS.md,
                // "the largest SOAP model on one H200").
                device_memory_bytes: Some(150_109_106_995),
            },
            // Simulated: 72 Neoverse V2 cores, NVLink-C2C 450 GB/s with coherent unified
            // memory, an H100-class GPU with asteria's H200 engine rate.
            // Estimated, not measured: a Grace core ~1.7x one of the H200 VM's x86 cores at
            // the power iteration + QR (~32 GFLOP/s measured there), all-core eigh ~4x.
            "gh200" => TargetDescription {
                name: "gh200".into(),
                host_cores: 72,
                host_gpu_gbps: Some(450.0),
                unified_memory: true,
                host_eigh_ms: scale(&h200_host_eigh, 0.25),
                host_qr_ms: scale(&h200_host_qr, 0.6),
                gpu_eigh_ms: scale(&h200_gpu_eigh, 1.1),
                gpu_qr_ms: scale(&h200_gpu_qr, 1.1),
                host_inverse_root_ms: vec![(1024, 108.0 * 0.6)],
                gpu_fp32_tflops: Some(45.0),
                train_tflops: 235.0,
                side_stream_interference: 0.6,
                nvme_read_gbps: Some(6.0),
                nvme_write_gbps: Some(5.0),
                host_update_gbps: None,
                // HBM3 of 96 or 144 GB and 480 GB of LPDDR5x depending on the part: unknown.
                device_memory_bytes: None,
            },
            // Simulated: 20 Arm cores (about the H200 VM's per core), one LPDDR5x pool shared
            // with a GPU ~1/8 of an H200 (asteria's engine rate scaled alike).
            "gb10" => TargetDescription {
                name: "gb10".into(),
                host_cores: 20,
                host_gpu_gbps: Some(273.0),
                unified_memory: true,
                host_eigh_ms: scale(&h200_host_eigh, 0.8),
                host_qr_ms: h200_host_qr,
                gpu_eigh_ms: scale(&h200_gpu_eigh, 8.0),
                gpu_qr_ms: scale(&h200_gpu_qr, 8.0),
                host_inverse_root_ms: vec![(1024, 108.0)],
                gpu_fp32_tflops: Some(50.0 / 8.0),
                train_tflops: 235.0 / 8.0,
                side_stream_interference: 0.8,
                nvme_read_gbps: Some(6.0),
                nvme_write_gbps: Some(5.0),
                host_update_gbps: None,
                // 128 GB of LPDDR5x, shared by the CPU and the GPU.
                device_memory_bytes: Some(128_000_000_000),
            },
            // A 2-core CI-class host without GPU (measured on the development machine with
            // `asteria calibrate`, rounded; the QR times one refresh per core with both cores
            // busy).
            "cpu" => TargetDescription {
                name: "cpu".into(),
                host_cores: 2,
                host_gpu_gbps: None,
                unified_memory: false,
                host_eigh_ms: vec![(64, 0.5), (256, 12.0), (1024, 420.0)],
                host_qr_ms: vec![(64, 0.3), (256, 3.5), (1024, 190.0)],
                gpu_eigh_ms: vec![],
                gpu_qr_ms: vec![],
                host_inverse_root_ms: vec![],
                gpu_fp32_tflops: None,
                train_tflops: 0.06,
                side_stream_interference: 0.0,
                nvme_read_gbps: Some(1.0),
                nvme_write_gbps: Some(0.8),
                // `asteria calibrate` on the 2-core development host, 2026-12-05.
                host_update_gbps: Some(32.0),
                device_memory_bytes: None,
            },
            _ => return None,
        })
    }

    /// Names of the built-in descriptions.
    pub const BUILTINS: [&'static str; 4] = ["h200", "gh200", "gb10", "cpu"];

    /// Threads of the host refresh pool: on a GPU target every core but the two that enqueue
    /// GPU work (the engine thread and the side-stream launcher), else every core; at least 1.
    pub fn host_pool_threads(&self) -> usize {
        if self.host_gpu_gbps.is_some() {
            self.host_cores.saturating_sub(2).max(1)
        } else {
            self.host_cores.max(1)
        }
    }

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

    /// Host inverse root (Shampoo, `optim::refresh_compute_inverse_root`) of an `n × n`
    /// factor, ms: `host_inverse_root_ms` (the QR refresh's `host_qr_ms` where it is empty),
    /// plus on a discrete GPU the copies (factor down, root up).
    pub fn host_inverse_root_ms(&self, n: usize) -> f64 {
        let table = if self.host_inverse_root_ms.is_empty() {
            &self.host_qr_ms
        } else {
            &self.host_inverse_root_ms
        };
        interpolate(table, n).unwrap_or(f64::INFINITY) + self.transfer_ms(n)
    }

    /// GPU inverse root of an `n × n` factor, ms (`None` without a GPU): the `syevd`
    /// (`gpu_eigh_ms`) plus the `2n³`-flop fp32 GEMM `V diag(w) Vᵀ` at `gpu_fp32_tflops`.
    pub fn gpu_inverse_root_ms(&self, n: usize) -> Option<f64> {
        if !self.has_gpu() {
            return None;
        }
        let gemm = self
            .gpu_fp32_tflops
            .map_or(0.0, |t| 2.0 * (n as f64).powi(3) / (t * 1e9));
        interpolate(&self.gpu_eigh_ms, n).map(|e| e + gemm)
    }

    /// Copy time (ms) of `bytes` between the device and the host tier, one way: the
    /// host↔GPU link, or on a host without GPU a memory copy (10 GB/s assumed).
    pub fn host_tier_ms(&self, bytes: usize) -> f64 {
        bytes as f64 / (self.host_gpu_gbps.unwrap_or(10.0) * 1e6)
    }

    /// Read (`write = false`) or write time (ms) of `bytes` on the NVMe tier.
    pub fn nvme_ms(&self, bytes: usize, write: bool) -> f64 {
        let gbps = if write {
            self.nvme_write_gbps
        } else {
            self.nvme_read_gbps
        };
        bytes as f64 / (gbps.unwrap_or(1.0) * 1e6)
    }

    /// Predicted step time (ms) of a model with `params` parameters and `tokens` per step.
    pub fn predicted_step_ms(&self, params: usize, tokens: usize) -> f64 {
        6.0 * params as f64 * tokens as f64 / (self.train_tflops * 1e9)
    }
}
