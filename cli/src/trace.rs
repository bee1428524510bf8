//! `--trace FILE.json`: the run's timeline as a Chrome / Perfetto trace (JSON array of trace
//! events, written by the maintained `tracing-chrome` layer from asteria's `tracing` spans).
//! Slices: each training step and its phases (`forward`, `backward`, `optimizer`, `host tasks`,
//! `synchronize`, `evaluate`) on the main thread; each plan op of the CPU engine (`op <name>`)
//! on the kernel pool's thread; preconditioner refreshes (`refresh <factor>`) on the host
//! pool's threads, and their launches, waits at the staleness bound and swaps
//! (`refresh launch|wait|swap <factor>`) on the main thread. Open it in ui.perfetto.dev or
//! chrome://tracing. A CUDA run adds a `GPU` process with one track per stream (`compute`,
//! `copy-in`, `copy-out`, `side`): every op of the programs on the stream it ran on and every
//! side-stream refresh, timed by CUDA events (`cuda::CudaEngine::take_gpu_trace`) and placed
//! on the same clock as the host slices; they are appended when the run ends ([`finish`]).
use std::path::Path;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::Subscriber;
use tracing_chrome::{ChromeLayerBuilder, EventOrSpan, FlushGuard};
use tracing_subscriber::filter::{EnvFilter, LevelFilter};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// A span's slice title: its name and its `name` field (`op embedding`, `refresh wte.R`).
struct SliceName(String);

/// Records [`SliceName`] in each new span's extensions (read by the trace's name function).
struct SliceNames;

struct NameField(Option<String>);

impl Visit for NameField {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "name" {
            self.0 = Some(value.to_string());
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "name" && self.0.is_none() {
            self.0 = Some(format!("{value:?}"));
        }
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for SliceNames {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut v = NameField(None);
        attrs.record(&mut v);
        if let (Some(name), Some(span)) = (v.0, ctx.span(id)) {
            let title = format!("{} {name}", attrs.metadata().name());
            span.extensions_mut().insert(SliceName(title));
        }
    }
}

/// Installs the global subscriber: warnings (or `RUST_LOG`) on stderr and, with `trace`, the
/// trace file. The returned guard writes the file's end when dropped (keep it until the run
/// is over).
///
/// # Errors
/// The trace file cannot be created (the message names it).
pub fn init(trace: Option<&Path>) -> Result<Option<FlushGuard>, String> {
    let stderr = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")));
    let registry = tracing_subscriber::registry().with(SliceNames).with(stderr);
    let Some(path) = trace else {
        registry.init();
        return Ok(None);
    };
    let file = std::fs::File::create(path)
        .map_err(|e| format!("cannot create the trace file {}: {e}", path.display()))?;
    // The layer's clock starts when it is built: the GPU slices are placed against this.
    let _ = START.set(Instant::now());
    let (chrome, guard) = ChromeLayerBuilder::new()
        .writer(file)
        .include_args(true)
        .name_fn(Box::new(|e| match e {
            EventOrSpan::Span(s) => s
                .extensions()
                .get::<SliceName>()
                .map_or_else(|| s.name().to_string(), |n| n.0.clone()),
            EventOrSpan::Event(ev) => ev.metadata().name().to_string(),
        }))
        .build();
    registry.with(chrome.with_filter(LevelFilter::DEBUG)).init();
    Ok(Some(guard))
}

/// When the trace's clock started (`ts` 0).
static START: OnceLock<Instant> = OnceLock::new();

/// GPU slices to append at the end: `(device label, slices, dropped)`.
static GPU: Mutex<Vec<(String, Vec<cuda::engine_trace::GpuSlice>, u64)>> = Mutex::new(Vec::new());

/// Hands the GPU slices of a run (`device`: `cuda:0 NVIDIA H200`) to [`finish`].
pub fn add_gpu(device: String, slices: Vec<cuda::engine_trace::GpuSlice>, dropped: u64) {
    if let Ok(mut g) = GPU.lock() {
        g.push((device, slices, dropped));
    }
}

/// Ends the trace: drops the `tracing-chrome` guard (which writes the file's end) and, when a
/// CUDA run handed its GPU slices over, appends them as a `GPU` process (pid 2 + device
/// index), one thread per stream, with `process_name` / `thread_name` metadata. The file is
/// rewritten through a temporary file and renamed.
///
/// # Errors
/// The trace file cannot be read back, parsed or rewritten (the message names it).
pub fn finish(guard: FlushGuard, path: &Path) -> Result<(), String> {
    drop(guard);
    let gpu = GPU
        .lock()
        .map(|mut g| std::mem::take(&mut *g))
        .unwrap_or_default();
    match START.get() {
        Some(&start) if !gpu.is_empty() => merge_gpu(path, start, gpu),
        _ => Ok(()),
    }
}

/// Appends `gpu`'s slices to the trace-event array in `path` (see [`finish`]); `start` is the
/// instant of the trace's `ts` 0.
fn merge_gpu(
    path: &Path,
    start: Instant,
    gpu: Vec<(String, Vec<cuda::engine_trace::GpuSlice>, u64)>,
) -> Result<(), String> {
    let io = |e: &dyn std::fmt::Display| format!("trace file {}: {e}", path.display());
    let text = std::fs::read_to_string(path).map_err(|e| io(&e))?;
    let mut events: Vec<serde_json::Value> = serde_json::from_str(&text).map_err(|e| io(&e))?;
    const STREAMS: [&str; 4] = ["compute", "copy-in", "copy-out", "side"];
    for (d, (device, slices, dropped)) in gpu.into_iter().enumerate() {
        let pid = 2 + d;
        events.push(serde_json::json!({
            "ph": "M", "name": "process_name", "pid": pid, "tid": 0,
            "args": { "name": format!("GPU {device}") },
        }));
        for (i, s) in STREAMS.iter().enumerate() {
            events.push(serde_json::json!({
                "ph": "M", "name": "thread_name", "pid": pid, "tid": i + 1,
                "args": { "name": format!("{s} stream") },
            }));
        }
        for s in slices {
            let ts = s.start.saturating_duration_since(start).as_secs_f64() * 1e6;
            let tid = STREAMS.iter().position(|&x| x == s.stream).unwrap_or(0) + 1;
            events.push(serde_json::json!({
                "ph": "X", "name": s.name, "cat": s.stream, "pid": pid, "tid": tid,
                "ts": ts, "dur": s.dur_us,
            }));
        }
        if dropped > 0 {
            tracing::warn!(dropped, "GPU trace slices over the limit were not kept");
        }
    }
    let tmp = path.with_extension("json.tmp");
    let bytes = serde_json::to_vec(&events).map_err(|e| io(&e))?;
    std::fs::write(&tmp, bytes).map_err(|e| io(&e))?;
    std::fs::rename(&tmp, path).map_err(|e| io(&e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use cuda::engine_trace::GpuSlice;
    use std::time::Duration;

    #[test]
    fn gpu_slices_join_the_host_trace_as_a_gpu_process_with_a_track_per_stream() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.json");
        // What tracing-chrome writes: a JSON array of B/E events of pid 1.
        std::fs::write(
            &path,
            r#"[
{"ph":"B","pid":1,"tid":0,"ts":10.0,"name":"step"},
{"ph":"E","pid":1,"tid":0,"ts":900.0,"name":"step"}
]"#,
        )
        .expect("write");
        let start = Instant::now();
        let at = |us: u64| start + Duration::from_micros(us);
        let slices = vec![
            GpuSlice {
                stream: "compute",
                name: "forward/mat_mul".into(),
                start: at(100),
                dur_us: 50.0,
            },
            GpuSlice {
                stream: "side",
                name: "refresh wte.L".into(),
                start: at(120),
                dur_us: 400.0,
            },
            GpuSlice {
                stream: "copy-in",
                name: "optimizer/copy_in".into(),
                start: at(130),
                dur_us: 5.0,
            },
        ];
        merge_gpu(&path, start, vec![("cuda:0 NVIDIA H200".into(), slices, 0)]).expect("merge");
        let ev: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        assert_eq!(
            ev.len(),
            2 + 1 + 4 + 3,
            "host events, process name, 4 thread names, 3 slices"
        );
        assert!(ev.iter().any(|e| e["ph"] == "M"
            && e["name"] == "process_name"
            && e["pid"] == 2
            && e["args"]["name"] == "GPU cuda:0 NVIDIA H200"));
        let track = |stream: &str| {
            ev.iter()
                .find(|e| {
                    e["ph"] == "M"
                        && e["name"] == "thread_name"
                        && e["args"]["name"] == format!("{stream} stream")
                })
                .map(|e| e["tid"].clone())
                .expect("thread name")
        };
        for (name, stream, ts, dur) in [
            ("forward/mat_mul", "compute", 100.0, 50.0),
            ("refresh wte.L", "side", 120.0, 400.0),
            ("optimizer/copy_in", "copy-in", 130.0, 5.0),
        ] {
            let e = ev.iter().find(|e| e["name"] == name).expect("slice");
            assert_eq!(e["ph"], "X");
            assert_eq!(e["pid"], 2);
            assert_eq!(e["tid"], track(stream), "{name} on the {stream} track");
            assert!((e["ts"].as_f64().expect("ts") - ts).abs() < 1.0, "{e}");
            assert_eq!(e["dur"].as_f64(), Some(dur));
        }
        // A trace file that is not a JSON array is an error naming it.
        std::fs::write(&path, "not json").expect("write");
        let err = merge_gpu(&path, start, vec![("x".into(), Vec::new(), 0)]).expect_err("bad file");
        assert!(err.contains("t.json"), "{err}");
    }
}
