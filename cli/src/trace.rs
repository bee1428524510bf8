//! `--trace FILE.json`: the run's timeline as a Chrome / Perfetto trace (JSON array of trace
//! events, written by the maintained `tracing-chrome` layer from asteria's `tracing` spans).
//! Slices: each training step and its phases (`forward`, `backward`, `optimizer`, `host tasks`,
//! `synchronize`, `evaluate`) on the main thread; each plan op of the CPU engine (`op <name>`)
//! on the kernel pool's thread; preconditioner refreshes (`refresh <factor>`) on the host
//! pool's threads, and their launches, waits at the staleness bound and swaps
//! (`refresh launch|wait|swap <factor>`) on the main thread. Open it in ui.perfetto.dev or
//! chrome://tracing. The CUDA engine's streams (GPU time) are not in it yet: its run shows
//! the host side only.
use std::path::Path;
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
