//! GPU energy through NVML (`nvml-wrapper`, which opens `libnvidia-ml.so.1` at run time like the
//! other CUDA libraries): joules since the meter was opened, for the training loop's per-step
//! `energy_j` / `step_j` metrics and the run summary's joules per token.
//!
//! Two sources, the first that works:
//! - **counter**: `nvmlDeviceGetTotalEnergyConsumption`, the board's energy counter in mJ
//!   (Volta and newer): exact over any window, read at step boundaries.
//! - **sampled**: where the counter is not supported, `nvmlDeviceGetPowerUsage` (mW) read by a
//!   background thread every [`SAMPLE_PERIOD`] and integrated (trapezoids); accurate to the
//!   power's variation within a period.
//!
//! The reading is the whole board's: other processes on the same GPU count too. The meter
//! never changes what runs; a GPU or driver without NVML gives no meter (the run says so).
use nvml_wrapper::Nvml;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Period of the power sampler (the fallback source).
pub const SAMPLE_PERIOD: Duration = Duration::from_millis(20);

enum Source {
    /// Counter reading (mJ) when the meter was opened.
    Counter { start_mj: u64 },
    /// Integrated joules, shared with the sampler thread.
    Sampled {
        joules: Arc<Mutex<f64>>,
        stop: Arc<AtomicBool>,
        thread: Option<std::thread::JoinHandle<()>>,
    },
}

/// Energy of one GPU since [`EnergyMeter::open`].
pub struct EnergyMeter {
    nvml: Arc<Nvml>,
    index: u32,
    source: Source,
    name: String,
}

impl std::fmt::Debug for EnergyMeter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EnergyMeter({})", self.describe())
    }
}

impl EnergyMeter {
    /// Opens NVML and the GPU at PCI bus id `pci_bus_id` (`"00000000:19:00.0"`, what
    /// [`crate::DeviceInfo::pci_bus_id`] holds: CUDA ordinals and NVML indices may differ).
    ///
    /// # Errors
    /// A message: NVML cannot be loaded or initialised, no device has that bus id, or neither
    /// the energy counter nor the power reading is supported.
    pub fn open(pci_bus_id: &str) -> Result<Self, String> {
        let nvml = Nvml::init().map_err(|e| format!("NVML: {e}"))?;
        // The device handle borrows `nvml`: read what is needed, then let it go.
        let (index, name, counter, power) = {
            let dev = nvml
                .device_by_pci_bus_id(pci_bus_id)
                .map_err(|e| format!("NVML: no device at PCI bus {pci_bus_id}: {e}"))?;
            let index = dev
                .index()
                .map_err(|e| format!("NVML: device index: {e}"))?;
            let name = dev.name().unwrap_or_else(|_| "GPU".into());
            (
                index,
                name,
                dev.total_energy_consumption(),
                dev.power_usage(),
            )
        };
        let nvml = Arc::new(nvml);
        let source = match (counter, power) {
            (Ok(start_mj), _) => Source::Counter { start_mj },
            (Err(_), Ok(_)) => {
                let joules = Arc::new(Mutex::new(0.0));
                let stop = Arc::new(AtomicBool::new(false));
                let (n, j, s) = (Arc::clone(&nvml), Arc::clone(&joules), Arc::clone(&stop));
                let thread = std::thread::Builder::new()
                    .name("nvml-power".into())
                    .spawn(move || sample(&n, index, &j, &s))
                    .map_err(|e| format!("starting the power sampler: {e}"))?;
                Source::Sampled {
                    joules,
                    stop,
                    thread: Some(thread),
                }
            }
            (Err(c), Err(p)) => {
                return Err(format!(
                    "NVML: {name} reports neither its energy counter ({c}) nor its power ({p})"
                ))
            }
        };
        Ok(EnergyMeter {
            nvml,
            index,
            source,
            name,
        })
    }

    /// Joules since [`EnergyMeter::open`]; `None` when a reading fails (the caller records
    /// no energy for that step).
    pub fn joules(&self) -> Option<f64> {
        match &self.source {
            Source::Counter { start_mj } => {
                let dev = self.nvml.device_by_index(self.index).ok()?;
                let now = dev.total_energy_consumption().ok()?;
                Some(now.saturating_sub(*start_mj) as f64 / 1e3)
            }
            Source::Sampled { joules, .. } => joules.lock().ok().map(|j| *j),
        }
    }

    /// `"NVIDIA H200, NVML energy counter"` (or `power sampled every 20 ms`).
    pub fn describe(&self) -> String {
        match self.source {
            Source::Counter { .. } => format!("{}, NVML energy counter", self.name),
            Source::Sampled { .. } => format!(
                "{}, NVML power sampled every {} ms",
                self.name,
                SAMPLE_PERIOD.as_millis()
            ),
        }
    }
}

impl Drop for EnergyMeter {
    fn drop(&mut self) {
        if let Source::Sampled { stop, thread, .. } = &mut self.source {
            stop.store(true, Ordering::SeqCst);
            if let Some(t) = thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// The sampler thread: integrates power (trapezoids over measured intervals) until `stop`.
fn sample(nvml: &Nvml, index: u32, joules: &Mutex<f64>, stop: &AtomicBool) {
    let read = || -> Option<f64> {
        let d = nvml.device_by_index(index).ok()?;
        d.power_usage().ok().map(|mw| mw as f64 / 1e3)
    };
    let (mut last_t, mut last_w) = (Instant::now(), read().unwrap_or(0.0));
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(SAMPLE_PERIOD);
        let Some(w) = read() else { continue };
        let now = Instant::now();
        let dt = now.duration_since(last_t).as_secs_f64();
        if let Ok(mut j) = joules.lock() {
            *j += 0.5 * (w + last_w) * dt;
        }
        (last_t, last_w) = (now, w);
    }
}

/// GPU memory this process holds on the GPU at PCI bus id `pci_bus_id`, as NVML reports it
/// (`nvmlDeviceGetComputeRunningProcesses`: arenas, context, kernel modules and library
/// workspaces together, in bytes); `None` when NVML is missing, the process is not listed
/// (a PID namespace NVML does not see into) or the driver does not report per-process memory.
pub fn process_gpu_bytes(pci_bus_id: &str) -> Option<u64> {
    let nvml = Nvml::init().ok()?;
    let dev = nvml.device_by_pci_bus_id(pci_bus_id).ok()?;
    let me = std::process::id();
    dev.running_compute_processes()
        .ok()?
        .into_iter()
        .find(|p| p.pid == me)
        .and_then(|p| match p.used_gpu_memory {
            nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some(b),
            nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
        })
}
