//! GPU energy through NVML (`nvml-wrapper`, which opens `libnvidia-ml.so.1` at run time like the
//! other CUDA libraries): joules since the meter was opened, for the training loop's per-step
//! `energy_j` / `step_j` metrics and the run summary's joules per token.
//!
//! Two sources, the first that works, each read by a background thread (never on the thread
//! that launches the GPU's work):
//! - **counter**: `nvmlDeviceGetTotalEnergyConsumption`, the board's energy counter in mJ
//!   (Volta and newer), read every [`COUNTER_PERIOD`]. Exact over any window between two
//!   readings; a step's joules are the difference of the latest readings at its boundaries, each
//!   at most a period plus one read old. The read itself takes ~3 ms on the H200 (median of 50,
//!   up to 15 ms; 2026-12-04): read at every step boundary on the training thread it delayed
//!   each step's first launch by that much.
//! - **sampled**: where the counter is not supported, `nvmlDeviceGetPowerUsage` (mW) read every
//!   [`SAMPLE_PERIOD`] and integrated (trapezoids); accurate to the power's variation within a
//!   period.
//!
//! The reading is the whole board's: other processes on the same GPU count too. The meter
//! never changes what runs; a GPU or driver without NVML gives no meter (the run says so).
use nvml_wrapper::Nvml;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Period of the power sampler (the fallback source).
pub const SAMPLE_PERIOD: Duration = Duration::from_millis(20);

/// Period of the energy-counter reader (sleep between reads).
pub const COUNTER_PERIOD: Duration = Duration::from_millis(10);

/// A reading older than this is no reading: the reads have been failing (or the thread has
/// stopped), and a step would otherwise be credited with zero joules.
pub const STALE_AFTER: Duration = Duration::from_millis(500);

/// The reader thread's last successful reading: joules since the meter was opened, and when.
#[derive(Clone, Copy, Debug)]
struct Reading {
    joules: f64,
    at: Instant,
}

/// Which NVML reading the meter's thread takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// The energy counter; its reading (mJ) when the meter was opened.
    Counter { start_mj: u64 },
    /// Power, integrated.
    Sampled,
}

/// Energy of one GPU since [`EnergyMeter::open`].
pub struct EnergyMeter {
    source: Source,
    name: String,
    /// The thread's last successful reading (the counter's at open to start with).
    joules: Arc<Mutex<Reading>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for EnergyMeter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EnergyMeter({})", self.describe())
    }
}

impl EnergyMeter {
    /// Opens NVML and the GPU at PCI bus id `pci_bus_id` (`"00000000:19:00.0"`, what
    /// [`crate::DeviceInfo::pci_bus_id`] holds: CUDA ordinals and NVML indices may differ),
    /// and starts the reader thread.
    ///
    /// # Errors
    /// A message: NVML cannot be loaded or initialised, no device has that bus id, neither
    /// the energy counter nor the power reading is supported, or the thread cannot start.
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
        let source = match (counter, power) {
            (Ok(start_mj), _) => Source::Counter { start_mj },
            (Err(_), Ok(_)) => Source::Sampled,
            (Err(c), Err(p)) => {
                return Err(format!(
                    "NVML: {name} reports neither its energy counter ({c}) nor its power ({p})"
                ))
            }
        };
        let joules = Arc::new(Mutex::new(Reading {
            joules: 0.0,
            at: Instant::now(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let (j, st) = (Arc::clone(&joules), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("nvml-energy".into())
            .spawn(move || read_loop(&nvml, index, source, &j, &st))
            .map_err(|e| format!("starting the energy reader: {e}"))?;
        Ok(EnergyMeter {
            source,
            name,
            joules,
            stop,
            thread: Some(thread),
        })
    }

    /// Joules since [`EnergyMeter::open`], as the reader thread last read them (no NVML call
    /// here); `None` when its last successful reading is older than [`STALE_AFTER`] (the
    /// caller records no energy for that step then).
    pub fn joules(&self) -> Option<f64> {
        let r = *self.joules.lock().ok()?;
        (r.at.elapsed() <= STALE_AFTER).then_some(r.joules)
    }

    /// `"NVIDIA H200, NVML energy counter read every 10 ms"` (or `power sampled every 20 ms`).
    pub fn describe(&self) -> String {
        match self.source {
            Source::Counter { .. } => format!(
                "{}, NVML energy counter read every {} ms",
                self.name,
                COUNTER_PERIOD.as_millis()
            ),
            Source::Sampled => format!(
                "{}, NVML power sampled every {} ms",
                self.name,
                SAMPLE_PERIOD.as_millis()
            ),
        }
    }
}

impl Drop for EnergyMeter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The reader thread, until `stop`: the counter's joules since `start_mj` every
/// [`COUNTER_PERIOD`], or power integrated (trapezoids over measured intervals) every
/// [`SAMPLE_PERIOD`]. A failed reading leaves the last one, which [`EnergyMeter::joules`]
/// stops reporting once it is [`STALE_AFTER`] old.
fn read_loop(nvml: &Nvml, index: u32, source: Source, joules: &Mutex<Reading>, stop: &AtomicBool) {
    let power = || -> Option<f64> {
        let d = nvml.device_by_index(index).ok()?;
        d.power_usage().ok().map(|mw| mw as f64 / 1e3)
    };
    let first_w = match source {
        Source::Sampled => power().unwrap_or(0.0),
        Source::Counter { .. } => 0.0,
    };
    let (mut last_t, mut last_w) = (Instant::now(), first_w);
    while !stop.load(Ordering::SeqCst) {
        match source {
            Source::Counter { start_mj } => {
                let now = nvml
                    .device_by_index(index)
                    .ok()
                    .and_then(|d| d.total_energy_consumption().ok());
                if let (Some(mj), Ok(mut j)) = (now, joules.lock()) {
                    *j = Reading {
                        joules: mj.saturating_sub(start_mj) as f64 / 1e3,
                        at: Instant::now(),
                    };
                }
                std::thread::sleep(COUNTER_PERIOD);
            }
            Source::Sampled => {
                std::thread::sleep(SAMPLE_PERIOD);
                let Some(w) = power() else { continue };
                let now = Instant::now();
                let dt = now.duration_since(last_t).as_secs_f64();
                if let Ok(mut j) = joules.lock() {
                    *j = Reading {
                        joules: j.joules + 0.5 * (w + last_w) * dt,
                        at: now,
                    };
                }
                (last_t, last_w) = (now, w);
            }
        }
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
