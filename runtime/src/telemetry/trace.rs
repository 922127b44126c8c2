//! OpenTelemetry traces of handler requests, exported over OTLP/HTTP
//! (protobuf) when an endpoint is configured by OpenTelemetry's standard
//! variables; off otherwise, and then nothing is built or recorded.
//!
//! One trace per request. The server span (`POST /v1/{tenant}/{handler}`,
//! the parent an incoming `traceparent` names) has children for
//! authentication and admission, reading the body, instantiation and the
//! guest; the guest's span has one `infer` span per call. The batch a call
//! ran in is a span of its own trace (a batch serves many requests), linked
//! to the `infer` span of each member, with its size, model and device; the
//! call's wait in the queue is a `queue` child of its `infer` span.
//! Outgoing HTTP requests of a handler carry a `traceparent` naming its
//! guest span.
//!
//! Spans are made with explicit parents (no thread-local context: a request
//! moves between threads), most of them after the fact from the instants
//! the request already keeps.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context as _, bail};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator as _};
use opentelemetry::trace::{
    Link, SamplingDecision, SamplingResult, Span as _, SpanKind, Status, TraceContextExt as _, TraceId, TraceState, Tracer as _,
    TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracer, SdkTracerProvider, ShouldSample};

use facegate_host_gpu::{BatchObserver, BatchReport, CallTag};

/// Where traces go: OpenTelemetry's standard variables, each also a flag.
/// The sampler (`OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`), the
/// resource (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`), the export's
/// headers and timeout (`OTEL_EXPORTER_OTLP_HEADERS`, `…_TIMEOUT`) and the
/// span queue (`OTEL_BSP_MAX_QUEUE_SIZE`, …) are read by the OpenTelemetry
/// SDK itself.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TraceConfig {
    /// Base URL of an OTLP/HTTP collector (`/v1/traces` is appended), e.g.
    /// `http://localhost:4318`. Setting it turns traces on.
    #[arg(long = "otlp-endpoint", env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub endpoint: Option<String>,

    /// Full URL of the collector's traces endpoint (before `--otlp-endpoint`).
    #[arg(long = "otlp-traces-endpoint", env = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")]
    pub traces_endpoint: Option<String>,

    /// `otlp` (export; to `http://localhost:4318` without an endpoint) or
    /// `none` (no traces, whatever is set). Unset: export when an endpoint is set.
    #[arg(long = "traces-exporter", env = "OTEL_TRACES_EXPORTER")]
    pub exporter: Option<String>,

    /// The OTLP protocol: only `http/protobuf` (the default) is built in.
    #[arg(long = "otlp-protocol", env = "OTEL_EXPORTER_OTLP_PROTOCOL")]
    pub protocol: Option<String>,

    /// `true`: no traces, whatever else is set.
    #[arg(long = "otel-sdk-disabled", env = "OTEL_SDK_DISABLED", default_value_t = false, action = clap::ArgAction::Set,
        value_parser = clap::builder::BoolishValueParser::new())]
    pub disabled: bool,

    /// Longest a finished span waits before it is exported, ms.
    #[arg(long = "otlp-export-delay-ms", env = "OTEL_BSP_SCHEDULE_DELAY", default_value_t = 5_000)]
    pub export_delay_ms: u64,
}

impl TraceConfig {
    /// The traces endpoint's full URL, when traces are on.
    fn traces_url(&self) -> anyhow::Result<Option<String>> {
        let exporter = self.exporter.as_deref().map(str::trim).unwrap_or_default();
        if self.disabled || exporter == "none" {
            return Ok(None);
        }
        if !matches!(exporter, "" | "otlp") {
            bail!("OTEL_TRACES_EXPORTER={exporter:?}: facegate exports traces with `otlp` only (or `none`)");
        }
        for protocol in [self.protocol.clone(), std::env::var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").ok()].into_iter().flatten() {
            if !matches!(protocol.trim(), "" | "http/protobuf") {
                bail!(
                    "OTLP protocol {protocol:?}: facegate exports traces over http/protobuf only (a collector listens for it on port 4318)"
                );
            }
        }
        let url = match (&self.traces_endpoint, &self.endpoint) {
            (Some(url), _) if !url.trim().is_empty() => url.trim().to_owned(),
            (_, Some(base)) if !base.trim().is_empty() => format!("{}/v1/traces", base.trim().trim_end_matches('/')),
            _ if exporter == "otlp" => "http://localhost:4318/v1/traces".to_owned(),
            _ => return Ok(None),
        };
        Ok(Some(url))
    }
}

/// The gateway's tracer: on (an OTLP exporter) or off (nothing recorded).
#[derive(Clone, Default)]
pub struct Tracing {
    on: Option<(SdkTracerProvider, SdkTracer)>,
}

impl std::fmt::Debug for Tracing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracing").field("on", &self.on.is_some()).finish()
    }
}

impl Tracing {
    /// Traces as `config` says: off unless an endpoint (or the `otlp`
    /// exporter) is configured. `node` names this node in the resource
    /// (`service.instance.id`).
    pub fn new(config: &TraceConfig, node: &str) -> anyhow::Result<Self> {
        let Some(url) = config.traces_url()? else { return Ok(Self::default()) };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(url.clone())
            .build()
            .with_context(|| format!("OTLP exporter for {url}"))?;
        let batching = BatchConfigBuilder::default().with_scheduled_delay(Duration::from_millis(config.export_delay_ms)).build();
        let processor = BatchSpanProcessor::builder(exporter).with_batch_config(batching).build();
        // The sampler the standard variables configure (`Config::default` reads them).
        let sampler = LinkedSampled(opentelemetry_sdk::trace::Config::default().sampler);
        let provider =
            SdkTracerProvider::builder().with_span_processor(processor).with_sampler(sampler).with_resource(resource(node)).build();
        let tracer = provider.tracer("facegate");
        tracing::info!(endpoint = %url, "exporting traces over OTLP/HTTP");
        Ok(Self { on: Some((provider, tracer)) })
    }

    /// Whether spans are recorded and exported.
    pub fn is_on(&self) -> bool {
        self.on.is_some()
    }

    /// Opens the server span of a request that arrived at `started` for
    /// `route` (`/v1/{tenant}/{handler}`), the child of the `traceparent`
    /// in `headers` if there is one.
    pub fn server_span(
        &self,
        started: Instant,
        headers: &hyper::HeaderMap,
        (method, route, path): (&hyper::Method, &str, &str),
    ) -> ServerSpan {
        let Some((_, tracer)) = &self.on else { return ServerSpan::default() };
        let parent = TraceContextPropagator::new().extract(&HeaderReader(headers));
        let clock = Clock::now();
        let span = tracer
            .span_builder(format!("{method} {route}"))
            .with_kind(SpanKind::Server)
            .with_start_time(clock.wall(started))
            .with_attributes([
                KeyValue::new("http.request.method", method.to_string()),
                KeyValue::new("http.route", route.to_owned()),
                KeyValue::new("url.path", path.to_owned()),
                KeyValue::new("faas.trigger", "http"),
            ])
            .start_with_context(tracer, &parent);
        let cx = parent.with_span(span);
        ServerSpan { trace: RequestTrace::of(tracer, cx, clock) }
    }

    /// The observer that makes each batch's span (see the module docs), or
    /// `None` when traces are off.
    pub fn batch_observer(&self) -> Option<Arc<dyn BatchObserver>> {
        let (_, tracer) = self.on.as_ref()?;
        Some(Arc::new(BatchSpans { tracer: tracer.clone() }))
    }

    /// Exports what is left (at shutdown).
    pub fn shutdown(&self) {
        if let Some((provider, _)) = &self.on
            && let Err(e) = provider.shutdown()
        {
            tracing::warn!(error = %e, "traces left unexported at shutdown");
        }
    }
}

/// The configured sampler, except that a span linked to a sampled span is
/// sampled: a batch's span starts a trace of its own, and a sampler by
/// trace id would otherwise drop most batches that ran sampled requests.
#[derive(Debug, Clone)]
struct LinkedSampled(Box<dyn ShouldSample>);

impl ShouldSample for LinkedSampled {
    fn should_sample(
        &self,
        parent: Option<&Context>,
        trace_id: TraceId,
        name: &str,
        kind: &SpanKind,
        attributes: &[KeyValue],
        links: &[Link],
    ) -> SamplingResult {
        if links.iter().any(|l| l.span_context.is_sampled()) {
            return SamplingResult {
                decision: SamplingDecision::RecordAndSample,
                attributes: Vec::new(),
                trace_state: TraceState::default(),
            };
        }
        self.0.should_sample(parent, trace_id, name, kind, attributes, links)
    }
}

/// The resource: the service (`facegate`, unless the standard variables
/// name it), its version and this node.
fn resource(node: &str) -> Resource {
    let named = std::env::var("OTEL_SERVICE_NAME").is_ok_and(|v| !v.is_empty())
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|v| v.contains("service.name="));
    let builder = Resource::builder().with_attributes([
        KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
        KeyValue::new("service.instance.id", node.to_owned()),
    ]);
    if named { builder.build() } else { builder.with_service_name("facegate").build() }
}

/// Where a request is in its trace: the span new spans are children of.
/// Cheap to clone; does nothing when traces are off or the request is not
/// sampled.
#[derive(Clone, Default)]
pub struct RequestTrace {
    on: Option<Arc<Traced>>,
}

/// A recorded span and what its children are made with.
struct Traced {
    tracer: SdkTracer,
    /// The span, as a parent.
    cx: Context,
    /// The request's clock: every time of its spans is read from one pair
    /// of clocks, so a child's times fall within its parent's.
    clock: Clock,
}

/// A reading of the wall clock and the monotonic clock at one moment.
#[derive(Clone, Copy)]
struct Clock {
    system: SystemTime,
    instant: Instant,
}

impl Clock {
    fn now() -> Self {
        Self { system: SystemTime::now(), instant: Instant::now() }
    }

    /// The wall-clock time of `at`.
    fn wall(&self, at: Instant) -> SystemTime {
        if at >= self.instant { self.system + (at - self.instant) } else { self.system - (self.instant - at) }
    }
}

impl std::fmt::Debug for RequestTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestTrace").field("on", &self.on.is_some()).finish()
    }
}

impl RequestTrace {
    /// Children of `cx`'s span, if it is sampled.
    fn of(tracer: &SdkTracer, cx: Context, clock: Clock) -> Self {
        let sampled = cx.span().span_context().is_sampled();
        Self { on: sampled.then(|| Arc::new(Traced { tracer: tracer.clone(), cx, clock })) }
    }

    /// Whether spans made here are recorded.
    pub fn is_on(&self) -> bool {
        self.on.is_some()
    }

    /// A child span that ran from `start` to `end`, with `attributes` (not
    /// made unless the span is recorded).
    pub fn span(&self, name: &'static str, (start, end): (Instant, Instant), attributes: impl FnOnce() -> Vec<KeyValue>) {
        let Some(on) = &self.on else { return };
        let Traced { tracer, cx, clock } = &**on;
        let mut span =
            tracer.span_builder(name).with_start_time(clock.wall(start)).with_attributes(attributes()).start_with_context(tracer, cx);
        span.end_with_timestamp(clock.wall(end));
    }

    /// A failed child span that ran from `start` to `end`: `error` says why
    /// (`error.type`, and the span's status).
    pub fn failed(&self, name: &'static str, (start, end): (Instant, Instant), error: &str) {
        let Some(on) = &self.on else { return };
        let Traced { tracer, cx, clock } = &**on;
        let mut span = tracer
            .span_builder(name)
            .with_start_time(clock.wall(start))
            .with_attributes([KeyValue::new("error.type", error.to_owned())])
            .start_with_context(tracer, cx);
        span.set_status(Status::error(error.to_owned()));
        span.end_with_timestamp(clock.wall(end));
    }

    /// A child span from now until the returned span ends (or drops), with
    /// `attributes` (not made unless the span is recorded).
    pub fn start(&self, name: &'static str, attributes: impl FnOnce() -> Vec<KeyValue>) -> LiveSpan {
        let Some(on) = &self.on else { return LiveSpan::default() };
        let Traced { tracer, cx, clock } = &**on;
        let span = tracer
            .span_builder(name)
            .with_start_time(clock.wall(Instant::now()))
            .with_attributes(attributes())
            .start_with_context(tracer, cx);
        LiveSpan { trace: Self::of(tracer, cx.with_span(span), *clock) }
    }

    /// The `traceparent` (and `tracestate`) headers naming this span.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let Some(on) = &self.on else { return Vec::new() };
        let mut headers = HeaderWriter(Vec::new());
        TraceContextPropagator::new().inject_context(&on.cx, &mut headers);
        headers.0
    }

    /// Sets attributes on this span.
    pub fn set(&self, attributes: impl IntoIterator<Item = KeyValue>) {
        if let Some(on) = &self.on {
            on.cx.span().set_attributes(attributes);
        }
    }

    /// Marks this span failed with `message`.
    pub fn fail(&self, message: impl Into<Cow<'static, str>>) {
        if let Some(on) = &self.on {
            on.cx.span().set_status(Status::error(message));
        }
    }

    fn end(&self) {
        if let Some(on) = &self.on {
            on.cx.span().end_with_timestamp(on.clock.wall(Instant::now()));
        }
    }
}

/// A child span in progress ([`RequestTrace::start`]): spans made from its
/// [`LiveSpan::trace`] are its children; it ends when dropped.
#[derive(Default, Debug)]
pub struct LiveSpan {
    trace: RequestTrace,
}

impl LiveSpan {
    /// This span as a parent.
    pub fn trace(&self) -> &RequestTrace {
        &self.trace
    }

    /// A tag for a batcher call: the batch's span links to this span, and
    /// the call's wait becomes its `queue` child (see [`Tracing::batch_observer`]).
    pub fn call_tag(&self) -> Option<CallTag> {
        let on = self.trace.on.as_ref()?;
        Some(CallTag::new(Arc::clone(on)))
    }
}

impl Drop for LiveSpan {
    fn drop(&mut self) {
        self.trace.end();
    }
}

/// A request's server span: ends when dropped (when its answer's body is
/// sent, see `http::response::counted`).
#[derive(Default, Debug)]
pub struct ServerSpan {
    trace: RequestTrace,
}

impl ServerSpan {
    /// The request's trace, with this span as the parent.
    pub fn trace(&self) -> &RequestTrace {
        &self.trace
    }

    /// Records the handler that answers: its tenant, name, version and the
    /// request id (the sandbox adds `faas.coldstart`).
    pub fn handler(&self, (tenant, name, version): (&str, &str, i64), request_id: &str) {
        if !self.trace.is_on() {
            return;
        }
        self.trace.set([
            KeyValue::new("facegate.tenant", tenant.to_owned()),
            KeyValue::new("faas.name", name.to_owned()),
            KeyValue::new("faas.version", version.to_string()),
            KeyValue::new("faas.invocation_id", request_id.to_owned()),
        ]);
    }

    /// Records the answer's status; a 5xx marks the span failed (HTTP
    /// conventions: a server span's 4xx is the client's error, not its own).
    pub fn status(&self, status: u16) {
        if !self.trace.is_on() {
            return;
        }
        self.trace.set([KeyValue::new("http.response.status_code", i64::from(status))]);
        if status >= 500 {
            self.trace.set([KeyValue::new("error.type", status.to_string())]);
            self.trace.fail(format!("answered {status}"));
        }
    }
}

impl Drop for ServerSpan {
    fn drop(&mut self) {
        self.trace.end();
    }
}

/// Makes each batch's span, linked to its members' `infer` spans, and each
/// member's `queue` span (see [`Tracing::batch_observer`]).
struct BatchSpans {
    tracer: SdkTracer,
}

impl BatchObserver for BatchSpans {
    fn ran(&self, report: &BatchReport<'_>) {
        let members: Vec<(&Traced, Instant)> =
            report.members.iter().filter_map(|m| Some((&**m.tag.get::<Arc<Traced>>()?, m.enqueued))).collect();
        let links = members.iter().map(|(on, _)| Link::with_context(on.cx.span().span_context().clone())).collect();
        let clock = Clock::now();
        let mut batch = self
            .tracer
            .span_builder(format!("batch {}", report.model))
            .with_kind(SpanKind::Internal)
            .with_start_time(clock.wall(report.started))
            .with_links(links)
            .with_attributes([
                KeyValue::new("facegate.model", report.model.to_owned()),
                KeyValue::new("facegate.batch.size", report.size as i64),
                KeyValue::new("facegate.device", report.device_name.to_owned()),
                KeyValue::new("facegate.device.index", report.device as i64),
            ])
            .start_with_context(&self.tracer, &Context::new());
        if !report.ok {
            batch.set_status(Status::error("the batch failed"));
        }
        batch.end_with_timestamp(clock.wall(report.started + report.took));
        // Each wait on its request's clock, within its `infer` span.
        for (on, enqueued) in members {
            let mut queue =
                self.tracer.span_builder("queue").with_start_time(on.clock.wall(enqueued)).start_with_context(&self.tracer, &on.cx);
            queue.end_with_timestamp(on.clock.wall(report.started));
        }
    }
}

struct HeaderReader<'a>(&'a hyper::HeaderMap);

impl Extractor for HeaderReader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key)?.to_str().ok()
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(hyper::header::HeaderName::as_str).collect()
    }
}

struct HeaderWriter(Vec<(&'static str, String)>);

impl Injector for HeaderWriter {
    fn set(&mut self, key: &str, value: String) {
        let key = match key {
            "traceparent" => "traceparent",
            "tracestate" => "tracestate",
            _ => return,
        };
        self.0.push((key, value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(endpoint: Option<&str>, exporter: Option<&str>) -> TraceConfig {
        TraceConfig { endpoint: endpoint.map(str::to_owned), exporter: exporter.map(str::to_owned), ..TraceConfig::default() }
    }

    #[test]
    fn traces_are_on_only_when_an_endpoint_or_the_exporter_asks() {
        assert_eq!(config(None, None).traces_url().unwrap(), None);
        assert_eq!(config(Some("http://c:4318/"), None).traces_url().unwrap().as_deref(), Some("http://c:4318/v1/traces"));
        assert_eq!(config(None, Some("otlp")).traces_url().unwrap().as_deref(), Some("http://localhost:4318/v1/traces"));
        assert_eq!(config(Some("http://c:4318"), Some("none")).traces_url().unwrap(), None);
        let full = TraceConfig { traces_endpoint: Some("http://t/x".into()), ..config(Some("http://c"), None) };
        assert_eq!(full.traces_url().unwrap().as_deref(), Some("http://t/x"), "the traces endpoint wins");
        let disabled = TraceConfig { disabled: true, ..config(Some("http://c"), None) };
        assert_eq!(disabled.traces_url().unwrap(), None);
        assert!(config(Some("http://c"), Some("zipkin")).traces_url().is_err());
        let grpc = TraceConfig { protocol: Some("grpc".into()), ..config(Some("http://c"), None) };
        assert!(grpc.traces_url().unwrap_err().to_string().contains("http/protobuf"));
    }

    #[test]
    fn off_records_nothing_and_sends_no_header() {
        let tracing = Tracing::default();
        let server =
            tracing.server_span(Instant::now(), &hyper::HeaderMap::new(), (&hyper::Method::POST, "/v1/{tenant}/{handler}", "/v1/a/b"));
        assert!(!server.trace().is_on());
        let infer = server.trace().start("infer", || unreachable!("no attributes are made when off"));
        assert!(infer.call_tag().is_none());
        assert!(infer.trace().headers().is_empty());
        assert!(tracing.batch_observer().is_none());
    }

    #[test]
    fn a_span_linked_to_a_sampled_one_is_sampled_whatever_the_ratio() {
        use opentelemetry::trace::{SpanContext, SpanId, TraceFlags};
        let never = LinkedSampled(Box::new(opentelemetry_sdk::trace::Sampler::AlwaysOff));
        let linked = |flags| Link::with_context(SpanContext::new(TraceId::from(7), SpanId::from(9), flags, false, TraceState::default()));
        let decide = |links: &[Link]| never.should_sample(None, TraceId::from(1), "batch", &SpanKind::Internal, &[], links).decision;
        assert_eq!(decide(&[linked(TraceFlags::SAMPLED)]), SamplingDecision::RecordAndSample);
        assert_eq!(decide(&[linked(TraceFlags::default())]), SamplingDecision::Drop, "unsampled links: the configured sampler");
        assert_eq!(decide(&[]), SamplingDecision::Drop);
    }

    #[test]
    fn a_clock_keeps_the_gaps_between_instants_exactly() {
        let clock = Clock::now();
        let before = clock.instant - Duration::from_millis(40);
        let after = clock.instant + Duration::from_millis(250);
        assert_eq!(clock.wall(after).duration_since(clock.wall(before)).unwrap(), Duration::from_millis(290));
        assert_eq!(clock.wall(clock.instant), clock.system);
    }
}
