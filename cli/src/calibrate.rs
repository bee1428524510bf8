//! `asteria calibrate`: measures this host (eigensolve, power iteration and QR, GEMM rate, the
//! host AdamW kernel), optionally the GPU and the NVMe tier's drive, and writes the target
//! description the cost models read (`target { calibration = "FILE" }`).
use miette::{miette, IntoDiagnostic, Result, WrapErr};
use std::path::Path;
/// Read and write bandwidth (GB/s) of the NVMe store in `dir`: 256 MiB written and read back
/// (checksums verified) three times, medians.
fn measure_nvme(dir: &Path) -> Result<(f64, f64)> {
    const BYTES: usize = 256 << 20;
    let store = engine::nvme::NvmeStore::create(dir, "asteria-calibrate.nvme", BYTES as u64)
        .map_err(|e| miette!("{e}"))?;
    let data: Vec<u8> = (0..BYTES)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let mut back = vec![0u8; BYTES];
    let (mut w, mut r) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let t = std::time::Instant::now();
        store.write(0, &data).map_err(|e| miette!("{e}"))?;
        w.push(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        store.read(0, &mut back).map_err(|e| miette!("{e}"))?;
        r.push(t.elapsed().as_secs_f64());
    }
    if back != data {
        return Err(miette!(
            "NVMe calibration: the bytes read back differ from those written"
        ));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (rs, ws) = (median(&mut r), median(&mut w));
    let (read, write) = (BYTES as f64 / rs / 1e9, BYTES as f64 / ws / 1e9);
    note!(
        "NVMe store in {}: read {read:.2} GB/s, write {write:.2} GB/s (O_DIRECT {})",
        dir.display(),
        if store.stats().direct_io { "on" } else { "off" }
    );
    Ok((read, write))
}

fn median_ms(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?; // warm-up
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let s = std::time::Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64() * 1e3);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// `asteria calibrate`: measures this host's eigensolve and power-iteration+QR times and GEMM
/// rate (and with `device = Some("cuda")` the GPU's refresh times, host→device bandwidth and
/// bf16 GEMM rate), and writes a target description for the `precond-scheduling` cost model.
/// `sync_phases` (with `cuda`): the GPU refresher's printed phase times are GPU times, from
/// extra runs that synchronise after every phase (`cuda::calibrate::measure`). `nvme`: also the
/// NVMe store's read and write bandwidth in that directory (`tier-placement`'s NVMe costs).
///
/// # Errors
/// A device other than `cuda`, no CUDA driver or device, measurement or write failures, an
/// NVMe directory that is missing or full.
#[allow(clippy::too_many_arguments)]
pub fn calibrate(
    output: Option<&Path>,
    sizes: &[usize],
    threads: Option<usize>,
    reps: usize,
    device: Option<&str>,
    ordinal: usize,
    sync_phases: bool,
    nvme: Option<&Path>,
) -> Result<()> {
    let nvme_gbps = nvme.map(measure_nvme).transpose()?;
    let gpu = match device {
        None | Some("cpu") if sync_phases => {
            return Err(miette!(
                "`--sync-phases` times the GPU refresher's phases: add `--device cuda`"
            ))
        }
        None | Some("cpu") => None,
        Some("cuda") => {
            if !cuda::driver_present() {
                return Err(miette!(
                    "`--device cuda`: no CUDA driver (libcuda.so) can be loaded on this machine"
                ));
            }
            let g = cuda::calibrate::measure(ordinal, sizes, reps, sync_phases)
                .map_err(|e| miette!("GPU calibration: {e}"))?;
            for ((n, e), (_, q)) in g.eigh_ms.iter().zip(&g.qr_ms) {
                note!("GPU n = {n:>5}: syevd refresh {e:>9.2} ms   power iteration + QR refresh {q:>9.2} ms");
            }
            for (n, phases) in &g.qr_phases {
                note!("GPU n = {n:>5}: refresher phases, ms over all runs [{phases}]");
            }
            note!(
                "GPU {}: pinned host->device {:.1} GB/s, bf16 GEMM {:.0} TFLOP/s",
                g.device,
                g.h2d_gbps,
                g.bf16_gemm_tflops
            );
            Some(g)
        }
        Some(other) => {
            return Err(miette!(
                "`--device {other}`: calibrate knows `cpu` (the host only) and `cuda`"
            ))
        }
    };
    let threads =
        threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let pool = rayon_pool(threads)?;
    // The engines' host refresh pool: every core but the two that enqueue GPU work on a GPU
    // host (as `TargetDescription::host_pool_threads`).
    let refresh_threads = if gpu.is_some() {
        threads.saturating_sub(2).max(1)
    } else {
        threads
    };
    let refresh_pool = rayon_pool(refresh_threads)?;
    let solver = optim::solver_by_name("faer").map_err(|e| miette!("{e}"))?;
    let (mut eigh, mut qr) = (Vec::new(), Vec::new());
    let mut gflops = 0.0f64;
    pool.install(|| -> Result<()> {
        for &n in sizes {
            let a = optim::bench::random_spd_f32(n, 7);
            let e = median_ms(reps, || solver.eigh_f32(&a, n).map(|_| ()).map_err(|e| miette!("{e}")))?;
            let q = solver.eigh_f32(&a, n).map_err(|e| miette!("{e}"))?.vectors;
            let mut fq = vec![0.0f32; n * n];
            // One refresh on every thread of the refresh pool at once (`broadcast`), each
            // single-threaded: how the engines run asynchronous host refreshes; the wall time
            // of the batch is one refresh's time on one core of a busy pool.
            let r = median_ms(reps, || {
                refresh_pool
                    .broadcast(|_| {
                        optim::with_sequential(|| {
                            let mut fq = vec![0.0f32; n * n];
                            optim::matmul(&mut fq, &a, false, &q, false, n, n, n)
                                .map_err(|e| miette!("{e}"))?;
                            optim::thin_qr_q(&fq, n, n).map(|_| ()).map_err(|e| miette!("{e}"))
                        })
                    })
                    .into_iter()
                    .collect::<Result<()>>()
            })?;
            let mm = median_ms(reps, || optim::matmul(&mut fq, &a, false, &q, false, n, n, n).map_err(|e| miette!("{e}")))?;
            gflops = gflops.max(2.0 * (n as f64).powi(3) / (mm * 1e6));
            note!("n = {n:>5}: eigh {e:>9.2} ms   power iteration + QR (1 core of {refresh_threads} busy) {r:>9.2} ms   GEMM {:.1} GFLOP/s", 2.0 * (n as f64).powi(3) / (mm * 1e6));
            eigh.push((n, e));
            qr.push((n, r));
        }
        Ok(())
    })?;
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .unwrap_or_default();
    let mut desc = passes::cost_model::TargetDescription {
        name: format!("calibrated-{}", host.trim()),
        host_cores: threads,
        host_gpu_gbps: None,
        unified_memory: false,
        host_eigh_ms: eigh,
        host_qr_ms: qr,
        gpu_eigh_ms: vec![],
        gpu_qr_ms: vec![],
        // Not measured: inverse roots fall back to the QR times, the GPU GEMM is not counted.
        host_inverse_root_ms: vec![],
        gpu_fp32_tflops: None,
        // Whole training steps reach about half the GEMM rate on the CPU engine.
        train_tflops: 0.5 * gflops / 1e3,
        side_stream_interference: 0.0,
        nvme_read_gbps: nvme_gbps.map(|g| g.0),
        nvme_write_gbps: nvme_gbps.map(|g| g.1),
        host_update_gbps: Some(host_update_gbps(&pool, reps)?),
        device_memory_bytes: None,
    };
    if let Some(g) = gpu {
        desc.name = format!("{}-{}", desc.name, g.device.replace(' ', "_"));
        desc.host_gpu_gbps = Some(g.h2d_gbps);
        desc.device_memory_bytes = Some(g.total_memory_bytes);
        desc.gpu_eigh_ms = g.eigh_ms;
        desc.gpu_qr_ms = g.qr_ms;
        // asteria's CUDA engine reaches ~0.1 of the bf16 GEMM rate on whole GPT-2 steps
        // (73 of 755 TFLOP/s on the H200, BENCHMARKS.md); interference as the `h200` built-in
        // (not measured here).
        desc.train_tflops = 0.097 * g.bf16_gemm_tflops;
        desc.side_stream_interference = 0.6;
    }
    let json = serde_json::to_string_pretty(&desc).into_diagnostic()?;
    match output {
        Some(p) => {
            std::fs::write(p, &json)
                .into_diagnostic()
                .wrap_err_with(|| format!("cannot write {}", p.display()))?;
            note!(
                "wrote {} (name it in a spec: target cpu {{ calibration = \"{}\" }})",
                p.display(),
                p.display()
            );
        }
        None => out!("{json}"),
    }
    Ok(())
}

/// The host AdamW kernel's throughput on `pool` (every host core), GB/s of optimizer state
/// (`passes::cost_model::ADAMW_BYTES_PER_ELEMENT` per element): 16M elements (448 MB of state,
/// beyond the caches), the median of `reps` updates.
fn host_update_gbps(pool: &rayon::ThreadPool, reps: usize) -> Result<f64> {
    let n = 16usize << 20;
    let k = hostkernels::AdamWKernel::compile(&hostkernels::AdamWConstants {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    })
    .map_err(|e| miette!("compiling the host AdamW kernel: {e}"))?;
    let mut rng = engine::Rng::new(11);
    let mut fill = || -> Vec<f32> { (0..n).map(|_| rng.normal() as f32 * 0.02).collect() };
    let (mut p, g, mut m) = (fill(), fill(), fill());
    let mut v: Vec<f32> = fill().iter().map(|x| x * x).collect();
    let mut t = 0u64;
    let ms = pool.install(|| {
        median_ms(reps.max(3), || {
            t += 1;
            k.update(t, 1e-4, &mut p, &g, &mut m, &mut v)
                .map_err(|e| miette!("{e}"))
        })
    })?;
    let gbps = (n * passes::cost_model::ADAMW_BYTES_PER_ELEMENT) as f64 / (ms * 1e6);
    note!(
        "host AdamW kernel ({} threads): {ms:.2} ms per 16M elements, {gbps:.1} GB/s of state",
        pool.current_num_threads()
    );
    Ok(gbps)
}

fn rayon_pool(threads: usize) -> Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .into_diagnostic()
}
