//! JSON log lines with the OpenTelemetry `trace_id` and `span_id` of the
//! span the event happened in, so a log line leads to its trace.

use std::fmt;

use opentelemetry::trace::TraceContextExt;
use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// One JSON object per line: `timestamp`, `level`, `target`, the event's
/// fields (flattened, `message` included), `span` (the current span's name
/// and fields) and, inside a traced span, `trace_id` and `span_id`.
pub struct JsonWithTrace;

struct Fields<'a>(&'a mut Map<String, Value>);

impl Visit for Fields<'_> {
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.0.insert(field.name().into(), value.to_string().into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().into(), format!("{value:?}").into());
    }
}

impl<S, N> FormatEvent<S, N> for JsonWithTrace
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut obj = Map::new();
        let mut ts = String::new();
        if SystemTime.format_time(&mut Writer::new(&mut ts)).is_ok() {
            obj.insert("timestamp".into(), ts.into());
        }
        let meta = event.metadata();
        obj.insert("level".into(), meta.level().as_str().into());
        obj.insert("target".into(), meta.target().into());
        event.record(&mut Fields(&mut obj));
        if let Some(span) = ctx.lookup_current() {
            let mut s = Map::new();
            s.insert("name".into(), span.name().into());
            let ext = span.extensions();
            if let Some(fields) = ext.get::<FormattedFields<N>>()
                && let Ok(Value::Object(f)) = serde_json::from_str::<Value>(&fields.fields)
            {
                s.extend(f);
            }
            obj.insert("span".into(), Value::Object(s));
        }
        // Entering a traced span makes its context current on this thread.
        let cx = opentelemetry::Context::current();
        let sc = cx.span().span_context().clone();
        if sc.is_valid() {
            obj.insert("trace_id".into(), sc.trace_id().to_string().into());
            obj.insert("span_id".into(), sc.span_id().to_string().into());
        }
        writeln!(writer, "{}", Value::Object(obj))
    }
}

/// The field formatter to pair with [`JsonWithTrace`] (span fields as JSON).
pub fn fields() -> JsonFields {
    JsonFields::new()
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use opentelemetry::trace::TracerProvider as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl Write for Buf {
        fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(data);
            Ok(data.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn json_lines_carry_trace_and_span_ids() {
        let buf = Buf::default();
        let out = buf.clone();
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(
                tracing_subscriber::fmt::layer()
                    .event_format(JsonWithTrace)
                    .fmt_fields(fields())
                    .with_writer(move || out.clone()),
            )
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("unit")));
        let (trace_id, span_id) = tracing::subscriber::with_default(subscriber, || {
            tracing::info!("outside any span");
            let span = tracing::info_span!("unit.work", partition = 3);
            let _entered = span.enter();
            tracing::info!(n = 1, "hello");
            let cx = span.context();
            let sc = cx.span().span_context().clone();
            (sc.trace_id().to_string(), sc.span_id().to_string())
        });
        let text = String::from_utf8(buf.0.lock().expect("buffer").clone()).expect("utf-8");
        let lines: Vec<Value> =
            text.lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(lines[0].get("trace_id").is_none(), "{text}");
        let line = &lines[1];
        assert_eq!(line["message"], "hello");
        assert_eq!(line["n"], 1);
        assert_eq!(line["level"], "INFO");
        assert_eq!(line["span"]["name"], "unit.work");
        assert_eq!(line["span"]["partition"], 3);
        assert_eq!(line["trace_id"], trace_id.as_str());
        assert_eq!(line["span_id"], span_id.as_str());
        assert_eq!(trace_id.len(), 32);
    }
}
