//! Logs and traces.
//!
//! Logs go to standard error through `tracing` (`RUST_LOG` filters, default
//! `info`; `TURBINE_LOG_FORMAT=json` switches to JSON lines). When
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set, spans are also exported over
//! OTLP/gRPC (the standard `OTEL_*` variables configure the exporter and
//! `OTEL_SERVICE_NAME` overrides the service name), and the W3C trace
//! context propagator is installed so spans join across services.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Keeps the trace exporter alive; dropping it flushes pending spans.
#[derive(Debug)]
#[must_use = "dropping the guard stops trace export"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Whether spans are exported over OTLP.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(error) = provider.shutdown()
        {
            eprintln!("trace export shutdown failed: {error}");
        }
    }
}

/// Installs the global subscriber for `service_name`. Must be called inside
/// a Tokio runtime (the OTLP exporter's channel lives on it). Calling it
/// twice in one process keeps the first subscriber.
pub fn init(service_name: &str) -> TelemetryGuard {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("TURBINE_LOG_FORMAT").is_ok_and(|format| format.eq_ignore_ascii_case("json"));
    let fmt_layer = if json {
        tracing_subscriber::fmt::layer().json().with_writer(std::io::stderr).boxed()
    } else {
        tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_target(false).boxed()
    };

    let endpoint_set = ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"].iter().any(|key| std::env::var(key).is_ok_and(|v| !v.is_empty()));
    let provider = if endpoint_set { build_provider(service_name) } else { None };
    let otel_layer = provider.as_ref().map(|provider| {
        let tracer = provider.tracer("turbine");
        tracing_opentelemetry::layer().with_tracer(tracer).boxed()
    });
    let installed = tracing_subscriber::registry().with(filter).with(fmt_layer).with(otel_layer).try_init().is_ok();
    if installed && let Some(provider) = &provider {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        opentelemetry::global::set_tracer_provider(provider.clone());
        tracing::info!(service = service_name, "exporting traces over OTLP");
    }
    TelemetryGuard { provider: if installed { provider } else { None } }
}

fn build_provider(service_name: &str) -> Option<SdkTracerProvider> {
    let exporter = match opentelemetry_otlp::SpanExporter::builder().with_tonic().build() {
        Ok(exporter) => exporter,
        Err(error) => {
            eprintln!("OTLP trace exporter not started: {error}");
            return None;
        }
    };
    let name = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| service_name.to_owned());
    let resource = Resource::builder().with_service_name(name).build();
    // Export from Tokio tasks: the gRPC exporter's connection needs the
    // runtime's reactor, which the SDK's default dedicated export thread
    // lacks (its exports fail once the channel has to (re)connect).
    let processor = BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio).build();
    Some(SdkTracerProvider::builder().with_span_processor(processor).with_resource(resource).build())
}
