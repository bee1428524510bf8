//! GPU measurements for `asteria calibrate --device cuda` (the `precond-scheduling` cost
//! model's target description): eigenbasis-refresh times per factor size through the engine's
//! own refresher (`refresh::GpuRefresher` on the compute stream: `syevd` for the first basis,
//! power iteration + the tensor-core Rayleigh–Cholesky QR after, the status read included),
//! pinned host→device bandwidth, and the bf16 tensor-core GEMM rate.
use crate::device::Device;
use crate::error::{CudaError, Result, Tier};
use crate::memory::Elem;
use crate::refresh::{self, GpuRefresher, RefreshSlot};
use crate::{gemm, StreamKind};
use schedule::RefreshMethod;
use std::time::Instant;

/// What [`measure`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuCalibration {
    /// Device name.
    pub device: String,
    /// First-basis refresh (`syevd`) time per size, ms: `(n, ms)`.
    pub eigh_ms: Vec<(usize, f64)>,
    /// Power iteration + QR refresh time per size, ms.
    pub qr_ms: Vec<(usize, f64)>,
    /// Per size, the refresher's phase times (ms) summed over the init and QR runs, and its QR
    /// counters (`GpuRefresher::phase_ms_line`): host enqueue times, or with `sync_phases` GPU
    /// times of separate, synchronised runs. Not part of the calibration file.
    pub qr_phases: Vec<(usize, String)>,
    /// Pinned host → device copy bandwidth, GB/s.
    pub h2d_gbps: f64,
    /// bf16-input, fp32-accumulate GEMM rate at 8192³, TFLOP/s.
    pub bf16_gemm_tflops: f64,
    /// The device's memory as the driver reports its total, bytes.
    pub total_memory_bytes: u64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times `f` (which enqueues work) `reps` times after one warm-up, synchronizing the device
/// around each run; the median in ms.
fn timed(dev: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    dev.synchronize()?;
    let mut t = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        let s = Instant::now();
        f()?;
        dev.synchronize()?;
        t.push(s.elapsed().as_secs_f64() * 1e3);
    }
    Ok(median(t))
}

/// Measures device `ordinal` at factor sizes `sizes` with `reps` repetitions (median), with the
/// engine's refresher (so the cost model sees its times). `sync_phases`: the phase times
/// ([`GpuCalibration::qr_phases`]) come from a second refresher that synchronises after every
/// phase (`GpuRefresher::set_phase_sync`: GPU times), run as often as the timed one after it;
/// the refresh times stay those of the unsynchronised refresher.
///
/// # Errors
/// No driver / device / cuSOLVER ([`CudaError`]), allocation failures, and a refresh whose
/// status words report a failure on the random SPD inputs (a solver problem worth knowing).
pub fn measure(
    ordinal: usize,
    sizes: &[usize],
    reps: usize,
    sync_phases: bool,
) -> Result<GpuCalibration> {
    let dev = Device::new(ordinal)?;
    let mut rng = engine::Rng::new(7);
    let (mut eigh_ms, mut qr_ms, mut qr_phases) = (Vec::new(), Vec::new(), Vec::new());
    for &n in sizes.iter().filter(|&&n| n > 0) {
        // A well-conditioned SPD factor: G Gᵀ / n + I.
        let g: Vec<f64> = (0..n * n).map(|_| rng.normal()).collect();
        let mut f = vec![0.0f32; n * n];
        let mut fq = vec![0.0f64; n * n];
        let _ = optim::matmul(&mut fq, &g, false, &g, true, n, n, n);
        for i in 0..n {
            for j in 0..n {
                f[i * n + j] = (fq[i * n + j] / n as f64 + if i == j { 1.0 } else { 0.0 }) as f32;
            }
        }
        let (r, _) = GpuRefresher::new(&dev, StreamKind::Compute, n)?;
        let mut arena = dev.arena(
            "calibrate",
            Tier::Device,
            RefreshSlot::bytes(n) + 3 * n * n * 4 + 1024,
        )?;
        let slot = RefreshSlot::carve(&mut arena, n)?;
        let fb = arena.buf(Elem::F32, n * n)?;
        let qb = arena.buf(Elem::F32, n * n)?;
        dev.upload(&fb, &f)?;
        let run = |r: &GpuRefresher, init: bool| -> Result<()> {
            r.compute(&dev, init, RefreshMethod::Soap, n, &fb, &qb, &slot)?;
            let status = dev.download::<i32>(&slot.status)?;
            refresh::verdict(init, n, &status).map_err(|e| CudaError::Invalid {
                op: "calibrate",
                what: format!("refresh of a random SPD factor, n = {n}: {e}"),
            })
        };
        let e = timed(&dev, reps, || run(&r, true))?;
        dev.copy(&qb, &slot.q.slice(0, n * n)?, StreamKind::Compute)?;
        let q = timed(&dev, reps, || run(&r, false))?;
        let phases = if sync_phases {
            drop(r);
            let (mut rs, _) = GpuRefresher::new(&dev, StreamKind::Compute, n)?;
            rs.set_phase_sync(&dev);
            // As many runs as the timed ones (a warm-up and `reps`), from the same basis.
            for _ in 0..=reps.max(1) {
                run(&rs, true)?;
            }
            dev.copy(&qb, &slot.q.slice(0, n * n)?, StreamKind::Compute)?;
            for _ in 0..=reps.max(1) {
                run(&rs, false)?;
            }
            rs.phase_ms_line()
        } else {
            r.phase_ms_line()
        };
        qr_phases.push((n, phases));
        eigh_ms.push((n, e));
        qr_ms.push((n, q));
    }
    // Pinned host → device, 256 MiB.
    let bytes = 256usize << 20;
    let mut host = dev.arena("calibrate-pinned", Tier::PinnedHost, bytes + 1024)?;
    let hb = host.buf(Elem::F32, bytes / 4)?;
    let v: Vec<f32> = (0..bytes / 4).map(|i| (i % 977) as f32).collect();
    // SAFETY: `hb` is pinned host memory of exactly `v.len()` f32 and nothing reads it yet.
    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), hb.ptr() as *mut f32, v.len()) };
    let mut devm = dev.arena("calibrate-copy", Tier::Device, bytes + 1024)?;
    let db = devm.buf(Elem::F32, bytes / 4)?;
    let copy_ms = timed(&dev, reps, || dev.copy(&db, &hb, StreamKind::CopyIn))?;
    let h2d_gbps = bytes as f64 / (copy_ms * 1e6);
    // bf16 GEMM 8192³.
    let k = 8192usize;
    let mut garena = dev.arena("calibrate-gemm", Tier::Device, k * k * (2 + 2 + 4) + 4096)?;
    let (a, b, c) = (
        garena.buf(Elem::BF16, k * k)?,
        garena.buf(Elem::BF16, k * k)?,
        garena.buf(Elem::F32, k * k)?,
    );
    // Random operands (never time on all-zero data: the GPU clocks differently).
    let mut tmp = dev.arena("calibrate-fill", Tier::Device, k * k * 4 + 1024)?;
    let t32 = tmp.buf(Elem::F32, k * k)?;
    for x in [&a, &b] {
        let v: Vec<f32> = (0..k * k).map(|_| rng.normal() as f32).collect();
        dev.upload(&t32, &v)?;
        gemm::cast_f32_to_bf16(&dev, &t32, x)?;
    }
    let d = gemm::Dims::new(k, k);
    let gemm_ms = timed(&dev, reps, || {
        gemm::matmul_bf16(&dev, &a, d, &b, d, &c, false, false, false)
    })?;
    Ok(GpuCalibration {
        device: dev.info().name.clone(),
        eigh_ms,
        qr_ms,
        qr_phases,
        h2d_gbps,
        bf16_gemm_tflops: 2.0 * (k as f64).powi(3) / (gemm_ms * 1e9),
        total_memory_bytes: dev.info().total_mem as u64,
    })
}
