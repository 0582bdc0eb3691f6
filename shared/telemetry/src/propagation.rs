//! Trace context in NATS headers, through the process's propagator
//! (`OTEL_PROPAGATORS`, set by `init`: W3C `traceparent` / `tracestate` and
//! `baggage` unless told otherwise), the same one the HTTP servers extract
//! with.
//!
//! [`inject`] writes the context of the current span into a header map,
//! [`extract`] reads one back; [`parts`] / [`from_parts`] do the same for
//! contexts kept elsewhere ([`Parts`]: storage's outbox entries keep the
//! `traceparent`, `tracestate` and `baggage` of the command that caused
//! them, so that the change messages carry all three). Without `init`
//! (tests that never call it) there is no OpenTelemetry layer and no
//! propagator: nothing is injected or extracted.

use async_nats::HeaderMap;
use opentelemetry::Context;
use opentelemetry::baggage::BaggageExt;
use opentelemetry::global;
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Header names of the W3C trace context.
pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";
/// Header name of W3C baggage.
pub const BAGGAGE: &str = "baggage";

/// A context written as its header values, to be kept where headers are
/// not (an outbox entry); an empty string is a header the propagator did
/// not write.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Parts {
    pub traceparent: String,
    pub tracestate: String,
    pub baggage: String,
}

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

struct PartsExtractor<'a>(&'a Parts);

impl Extractor for PartsExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        let value = match key {
            TRACEPARENT => &self.0.traceparent,
            TRACESTATE => &self.0.tracestate,
            BAGGAGE => &self.0.baggage,
            _ => return None,
        };
        Some(value.as_str()).filter(|v| !v.is_empty())
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT, TRACESTATE, BAGGAGE]
    }
}

struct PartsInjector(Parts);

impl Injector for PartsInjector {
    fn set(&mut self, key: &str, value: String) {
        match key {
            TRACEPARENT => self.0.traceparent = value,
            TRACESTATE => self.0.tracestate = value,
            BAGGAGE => self.0.baggage = value,
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

/// The context carried by `headers` (empty when there is none) — theirs
/// only: nothing of the context active where it is read (its baggage, say)
/// is mixed in.
pub fn extract(headers: &HeaderMap) -> Context {
    global::get_text_map_propagator(|p| {
        p.extract_with_context(&Context::new(), &HeaderExtractor(headers))
    })
}

/// As [`extract`], for a message that may have no headers at all.
pub fn extract_opt(headers: Option<&HeaderMap>) -> Context {
    headers.map(extract).unwrap_or_default()
}

/// The header values of `cx` as the process's propagator writes them (no
/// `baggage` unless `OTEL_PROPAGATORS` has it); all empty when `cx` has no
/// valid span.
pub fn parts(cx: &Context) -> Parts {
    let mut out = PartsInjector(Parts::default());
    if is_valid(cx) {
        global::get_text_map_propagator(|p| p.inject_context(cx, &mut out));
    }
    out.0
}

/// The context written as [`Parts`], read back with the process's
/// propagator: what was kept and nothing else (an entry without baggage
/// does not take the baggage of the command being handled when it is
/// relayed).
pub fn from_parts(parts: &Parts) -> Context {
    global::get_text_map_propagator(|p| {
        p.extract_with_context(&Context::new(), &PartsExtractor(parts))
    })
}

/// The value of baggage entry `key` in `cx` (a handler asks
/// [`current_context`]).
pub fn baggage_value(cx: &Context, key: &str) -> Option<String> {
    cx.baggage().get(key).map(|v| v.as_str().to_string())
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

    fn written(traceparent: &str, tracestate: &str, baggage: &str) -> Parts {
        Parts {
            traceparent: traceparent.into(),
            tracestate: tracestate.into(),
            baggage: baggage.into(),
        }
    }

    #[test]
    fn round_trips_through_headers_and_parts() {
        global::set_text_map_propagator(crate::Options::default().text_map_propagator());
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = from_parts(&written(tp, "congo=t61rcWkgMzE", "tenant=acme,run=7"));
        assert!(is_valid(&cx));
        assert_eq!(baggage_value(&cx, "tenant").as_deref(), Some("acme"));
        let mut headers = HeaderMap::new();
        inject_context(&cx, &mut headers);
        assert_eq!(headers.get(TRACEPARENT).map(|v| v.as_str()), Some(tp));
        let back = extract(&headers);
        let mut baggage: Vec<_> =
            headers.get(BAGGAGE).map(|v| v.as_str()).unwrap_or("").split(',').collect();
        baggage.sort();
        assert_eq!(baggage, ["run=7", "tenant=acme"]);
        let kept = parts(&back);
        assert_eq!(
            (kept.traceparent.as_str(), kept.tracestate.as_str()),
            (tp, "congo=t61rcWkgMzE")
        );
        assert_eq!(baggage_value(&from_parts(&kept), "run").as_deref(), Some("7"));
        // An entry kept before baggage was: no baggage, the trace goes on —
        // also where a context with baggage is active.
        let _active = cx.clone().attach();
        let old = from_parts(&written(tp, "", ""));
        assert!(is_valid(&old) && baggage_value(&old, "tenant").is_none());
        assert_eq!(parts(&old).baggage, "");
        assert!(baggage_value(&extract(&HeaderMap::new()), "tenant").is_none());
        // Nothing to inject: the headers stay as they were.
        let mut empty = HeaderMap::new();
        inject_context(&Context::new(), &mut empty);
        assert!(empty.get(TRACEPARENT).is_none());
        assert!(!is_valid(&from_parts(&Parts::default())));
        assert!(!is_valid(&from_parts(&written("garbage", "", ""))));
    }
}
