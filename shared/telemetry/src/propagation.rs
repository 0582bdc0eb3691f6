//! Trace context in NATS headers, through the process's propagator
//! (`OTEL_PROPAGATORS`, set by `init`: W3C `traceparent` / `tracestate` and
//! `baggage` unless told otherwise), the same one the HTTP servers extract
//! with.
//!
//! [`inject`] writes the context of the current span into a header map,
//! [`extract`] reads one back; [`parts`] / [`from_parts`] do the same for
//! contexts kept elsewhere (storage's outbox entries keep `traceparent` and
//! `tracestate` only). Without `init` (tests that never call it) there is
//! no OpenTelemetry layer and no propagator: nothing is injected or
//! extracted.

use async_nats::HeaderMap;
use opentelemetry::Context;
use opentelemetry::global;
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Header names of the W3C trace context.
pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";

struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key, value);
    }
}

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(|v| v.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k.as_ref()).collect()
    }
}

struct PartsExtractor<'a> {
    traceparent: &'a str,
    tracestate: &'a str,
}

impl Extractor for PartsExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            TRACEPARENT if !self.traceparent.is_empty() => Some(self.traceparent),
            TRACESTATE if !self.tracestate.is_empty() => Some(self.tracestate),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT, TRACESTATE]
    }
}

struct PartsInjector {
    traceparent: String,
    tracestate: String,
}

impl Injector for PartsInjector {
    fn set(&mut self, key: &str, value: String) {
        match key {
            TRACEPARENT => self.traceparent = value,
            TRACESTATE => self.tracestate = value,
            _ => {}
        }
    }
}

/// The OpenTelemetry context of the current `tracing` span, or the context
/// active on this thread when that span is not traced (filtered out).
pub fn current_context() -> Context {
    let cx = tracing::Span::current().context();
    if cx.span().span_context().is_valid() { cx } else { Context::current() }
}

/// The OpenTelemetry context of `span` (empty when it is not traced).
pub fn context_of(span: &tracing::Span) -> Context {
    span.context()
}

/// True when `cx` carries a valid span context.
pub fn is_valid(cx: &Context) -> bool {
    cx.span().span_context().is_valid()
}

/// Writes the current span's context into `headers` (replacing any
/// `traceparent` / `tracestate` there). Nothing when there is none.
pub fn inject(headers: &mut HeaderMap) {
    inject_context(&current_context(), headers);
}

/// Writes `cx` into `headers`; nothing when `cx` has no valid span.
pub fn inject_context(cx: &Context, headers: &mut HeaderMap) {
    if is_valid(cx) {
        global::get_text_map_propagator(|p| p.inject_context(cx, &mut HeaderInjector(headers)));
    }
}

/// The context carried by `headers` (empty when there is none).
pub fn extract(headers: &HeaderMap) -> Context {
    global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)))
}

/// As [`extract`], for a message that may have no headers at all.
pub fn extract_opt(headers: Option<&HeaderMap>) -> Context {
    headers.map(extract).unwrap_or_default()
}

/// `(traceparent, tracestate)` of `cx`; empty strings when it has none.
pub fn parts(cx: &Context) -> (String, String) {
    let mut out = PartsInjector { traceparent: String::new(), tracestate: String::new() };
    if is_valid(cx) {
        global::get_text_map_propagator(|p| p.inject_context(cx, &mut out));
    }
    (out.traceparent, out.tracestate)
}

/// The context written as `traceparent` / `tracestate` strings.
pub fn from_parts(traceparent: &str, tracestate: &str) -> Context {
    global::get_text_map_propagator(|p| p.extract(&PartsExtractor { traceparent, tracestate }))
}

/// Makes `cx` the parent of `span`, when `cx` is valid. Call it before the
/// span is first entered.
pub fn set_parent(span: &tracing::Span, cx: Context) {
    if is_valid(&cx) {
        let _ = span.set_parent(cx);
    }
}

/// Adds a link from `span` to each valid, distinct context in `contexts`
/// (a span handling messages of several traces); `span` itself is skipped.
pub fn add_links<'a>(span: &tracing::Span, contexts: impl IntoIterator<Item = &'a Context>) {
    let mut seen = std::collections::HashSet::new();
    let own = span.context().span().span_context().clone();
    if own.is_valid() {
        seen.insert((own.trace_id(), own.span_id()));
    }
    for cx in contexts {
        let sc = cx.span().span_context().clone();
        if sc.is_valid() && seen.insert((sc.trace_id(), sc.span_id())) {
            span.add_link(sc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_headers_and_parts() {
        global::set_text_map_propagator(crate::Options::default().text_map_propagator());
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = from_parts(tp, "congo=t61rcWkgMzE");
        assert!(is_valid(&cx));
        let mut headers = HeaderMap::new();
        inject_context(&cx, &mut headers);
        assert_eq!(headers.get(TRACEPARENT).map(|v| v.as_str()), Some(tp));
        let back = extract(&headers);
        assert_eq!(parts(&back), (tp.to_string(), "congo=t61rcWkgMzE".to_string()));
        // Nothing to inject: the headers stay as they were.
        let mut empty = HeaderMap::new();
        inject_context(&Context::new(), &mut empty);
        assert!(empty.get(TRACEPARENT).is_none());
        assert!(!is_valid(&from_parts("", "")));
        assert!(!is_valid(&from_parts("garbage", "")));
    }
}
