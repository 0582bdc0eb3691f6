//! The standard `OTEL_*` variables this crate reads itself, parsed once at
//! start-up. A value that cannot be honoured is not silently dropped: it
//! becomes a [`Options::problems`] entry, logged as a warning once the
//! subscriber is installed, and the specification's default is used (the
//! SDK configuration rule: an invalid value behaves as if it were unset).

use std::path::PathBuf;
use std::time::Duration;

use opentelemetry::propagation::{TextMapCompositePropagator, TextMapPropagator};
use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};
use opentelemetry_sdk::trace::Sampler;

/// The OTLP transport (`OTEL_EXPORTER_OTLP_PROTOCOL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// `grpc`: the default here, as it was before the variable was read.
    #[default]
    Grpc,
    /// `http/protobuf`: `POST <endpoint>/v1/traces`.
    HttpProtobuf,
}

/// One entry of `OTEL_PROPAGATORS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Propagator {
    /// W3C `traceparent` / `tracestate`.
    TraceContext,
    /// W3C `baggage`.
    Baggage,
}

/// A file named by an `OTEL_*` variable, with the variable that named it
/// (errors about the file say both).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileVar {
    pub var: String,
    pub path: PathBuf,
}

/// The TLS files of an `https` endpoint, each from the traces variable
/// (`OTEL_EXPORTER_OTLP_TRACES_...`) or else the general one. Read and
/// checked by `init` (a file that cannot be used stops the start).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM CA certificate(s) trusted besides the system's roots
    /// (`..._CERTIFICATE`).
    pub certificate: Option<FileVar>,
    /// PEM client certificate chain for mTLS (`..._CLIENT_CERTIFICATE`).
    pub client_certificate: Option<FileVar>,
    /// PEM private key of the client certificate (`..._CLIENT_KEY`).
    pub client_key: Option<FileVar>,
}

impl TlsFiles {
    /// True when any file is named.
    pub fn any(&self) -> bool {
        self.certificate.is_some() || self.client_certificate.is_some() || self.client_key.is_some()
    }
}

/// Where traces go and how they are sampled and propagated;
/// [`Options::from_env`] reads the standard variables.
#[derive(Debug, Clone)]
pub struct Options {
    /// Where spans are sent, used as given (for `http/protobuf` the full
    /// URL, `/v1/traces` included); `None`: no export.
    pub otlp_endpoint: Option<String>,
    pub protocol: Protocol,
    pub sampler: Sampler,
    /// In order; empty: nothing is injected or extracted.
    pub propagators: Vec<Propagator>,
    /// CA and client certificate of an `https` endpoint.
    pub tls: TlsFiles,
    /// How long one export request may take (`OTEL_EXPORTER_OTLP_TIMEOUT`,
    /// milliseconds), for the HTTP client built here when there are TLS
    /// files; the SDK reads the same variables for everything else.
    pub export_timeout: Duration,
    /// Variables set to what cannot be honoured, and what is done instead.
    pub problems: Vec<String>,
}

impl Default for Options {
    /// No export, `parentbased_always_on`, `tracecontext,baggage`.
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            protocol: Protocol::default(),
            sampler: Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
            propagators: vec![Propagator::TraceContext, Propagator::Baggage],
            tls: TlsFiles::default(),
            export_timeout: opentelemetry_otlp::OTEL_EXPORTER_OTLP_TIMEOUT_DEFAULT,
            problems: Vec::new(),
        }
    }
}

const SAMPLERS: &str = "always_on, always_off, traceidratio, parentbased_always_on, \
                        parentbased_always_off, parentbased_traceidratio";

impl Options {
    /// From the process environment.
    pub fn from_env() -> Self {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// From `var` (the environment in [`Options::from_env`]; a map in tests).
    ///
    /// - endpoint: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` as is, else
    ///   `OTEL_EXPORTER_OTLP_ENDPOINT` (`/v1/traces` appended for HTTP);
    ///   none when `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`;
    /// - protocol: `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else
    ///   `OTEL_EXPORTER_OTLP_PROTOCOL`: `grpc` or `http/protobuf`;
    /// - `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG`;
    /// - `OTEL_PROPAGATORS`: `tracecontext`, `baggage`, `none`;
    /// - `OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE`, `_CLIENT_CERTIFICATE`,
    ///   `_CLIENT_KEY` (paths) and `OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let var = |k: &str| var(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let mut opts = Options::default();
        let problems = &mut opts.problems;
        opts.sampler = sampler(
            var("OTEL_TRACES_SAMPLER").as_deref(),
            var("OTEL_TRACES_SAMPLER_ARG").as_deref(),
            problems,
        );
        if let Some(list) = var("OTEL_PROPAGATORS") {
            opts.propagators = propagators(&list, problems);
        }
        let file = |setting: &str| {
            first_set(&var, traces_then_general(setting))
                .map(|(var, path)| FileVar { var, path: path.into() })
        };
        opts.tls = TlsFiles {
            certificate: file("CERTIFICATE"),
            client_certificate: file("CLIENT_CERTIFICATE"),
            client_key: file("CLIENT_KEY"),
        };
        opts.export_timeout = export_timeout(&var, problems);
        let exporter = var("OTEL_TRACES_EXPORTER");
        if let Some(e) = exporter.as_deref().filter(|e| !matches!(*e, "otlp" | "none")) {
            problems.push(format!("OTEL_TRACES_EXPORTER={e:?} is not supported: otlp is used"));
        }
        let disabled = var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
            || exporter.as_deref() == Some("none");
        let protocol_var = ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"]
            .into_iter()
            .find_map(|k| var(k).map(|v| (k, v)));
        let protocol = match protocol_var {
            None => Some(Protocol::default()),
            Some((k, v)) => match v.to_ascii_lowercase().as_str() {
                "grpc" => Some(Protocol::Grpc),
                "http/protobuf" => Some(Protocol::HttpProtobuf),
                _ => {
                    problems.push(format!(
                        "{k}={v:?} is not supported (grpc, http/protobuf): traces are not exported"
                    ));
                    None
                }
            },
        };
        let Some(protocol) = protocol else {
            return opts;
        };
        opts.protocol = protocol;
        let endpoint = var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| {
            var("OTEL_EXPORTER_OTLP_ENDPOINT").map(|base| match protocol {
                Protocol::Grpc => base,
                Protocol::HttpProtobuf => format!("{}/v1/traces", base.trim_end_matches('/')),
            })
        });
        opts.otlp_endpoint = endpoint.filter(|_| !disabled);
        if let Some(endpoint) = &opts.otlp_endpoint
            && !is_https(endpoint)
            && opts.tls.any()
        {
            let vars = opts.tls_vars().join(", ");
            opts.problems
                .push(format!("{vars} set, but {endpoint} is not an https endpoint: not used"));
        }
        opts
    }

    /// The variables that named the TLS files, in a fixed order.
    pub(crate) fn tls_vars(&self) -> Vec<&str> {
        let t = &self.tls;
        [&t.certificate, &t.client_certificate, &t.client_key]
            .into_iter()
            .flatten()
            .map(|f| f.var.as_str())
            .collect()
    }

    /// The propagator `OTEL_PROPAGATORS` asked for, composed in its order.
    pub(crate) fn text_map_propagator(&self) -> TextMapCompositePropagator {
        let parts = self
            .propagators
            .iter()
            .map(|p| -> Box<dyn TextMapPropagator + Send + Sync> {
                match p {
                    Propagator::TraceContext => Box::new(TraceContextPropagator::new()),
                    Propagator::Baggage => Box::new(BaggagePropagator::new()),
                }
            })
            .collect();
        TextMapCompositePropagator::new(parts)
    }
}

/// True when `endpoint` is an `https` URL (TLS is used).
pub(crate) fn is_https(endpoint: &str) -> bool {
    endpoint.get(..8).is_some_and(|scheme| scheme.eq_ignore_ascii_case("https://"))
}

/// The variable of one exporter setting (`CERTIFICATE`) for traces, then
/// the general one: the first set wins, as the specification says.
fn traces_then_general(setting: &str) -> [String; 2] {
    [format!("OTEL_EXPORTER_OTLP_TRACES_{setting}"), format!("OTEL_EXPORTER_OTLP_{setting}")]
}

/// The first of `names` that is set, with its value.
fn first_set(
    var: &impl Fn(&str) -> Option<String>,
    names: [String; 2],
) -> Option<(String, String)> {
    names.into_iter().find_map(|name| var(&name).map(|value| (name, value)))
}

/// `OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT` in milliseconds; the default (10 s)
/// when unset or not a number.
fn export_timeout(var: &impl Fn(&str) -> Option<String>, problems: &mut Vec<String>) -> Duration {
    let default = opentelemetry_otlp::OTEL_EXPORTER_OTLP_TIMEOUT_DEFAULT;
    let Some((name, value)) = first_set(var, traces_then_general("TIMEOUT")) else {
        return default;
    };
    match value.parse::<u64>() {
        Ok(ms) => Duration::from_millis(ms),
        Err(_) => {
            problems.push(format!(
                "{name}={value:?} is not a number of milliseconds: {} ms is used",
                default.as_millis()
            ));
            default
        }
    }
}

/// The sampler of `OTEL_TRACES_SAMPLER` / `_ARG`; `parentbased_always_on`
/// when unset or unknown.
fn sampler(name: Option<&str>, arg: Option<&str>, problems: &mut Vec<String>) -> Sampler {
    let ratio = |problems: &mut Vec<String>| match arg.map(str::parse::<f64>) {
        None => 1.0,
        Some(Ok(r)) if (0.0..=1.0).contains(&r) => r,
        Some(_) => {
            problems.push(format!(
                "OTEL_TRACES_SAMPLER_ARG={:?} is not a ratio between 0 and 1: 1.0 is used",
                arg.unwrap_or_default()
            ));
            1.0
        }
    };
    let parent_based = |root: Sampler| Sampler::ParentBased(Box::new(root));
    match name.map(str::to_ascii_lowercase).as_deref() {
        None | Some("parentbased_always_on") => parent_based(Sampler::AlwaysOn),
        Some("parentbased_always_off") => parent_based(Sampler::AlwaysOff),
        Some("parentbased_traceidratio") => {
            parent_based(Sampler::TraceIdRatioBased(ratio(problems)))
        }
        Some("always_on") => Sampler::AlwaysOn,
        Some("always_off") => Sampler::AlwaysOff,
        Some("traceidratio") => Sampler::TraceIdRatioBased(ratio(problems)),
        Some(other) => {
            problems.push(format!(
                "OTEL_TRACES_SAMPLER={other:?} is not supported ({SAMPLERS}): \
                 parentbased_always_on is used"
            ));
            parent_based(Sampler::AlwaysOn)
        }
    }
}

/// The propagators of a comma-separated `OTEL_PROPAGATORS`, unknown names
/// left out (and reported).
fn propagators(list: &str, problems: &mut Vec<String>) -> Vec<Propagator> {
    let mut out = Vec::new();
    for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let p = match name.to_ascii_lowercase().as_str() {
            "tracecontext" => Propagator::TraceContext,
            "baggage" => Propagator::Baggage,
            "none" => continue,
            _ => {
                problems.push(format!(
                    "OTEL_PROPAGATORS: {name:?} is not supported (tracecontext, baggage, none): \
                     left out"
                ));
                continue;
            }
        };
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn from(vars: &[(&str, &str)]) -> Options {
        let map: HashMap<String, String> =
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Options::from_vars(|k| map.get(k).cloned())
    }

    fn described(s: &Sampler) -> String {
        format!("{s:?}")
    }

    #[test]
    fn nothing_set_means_no_export_and_the_specification_defaults() {
        let o = from(&[]);
        assert_eq!(o.otlp_endpoint, None);
        assert_eq!(o.protocol, Protocol::Grpc);
        assert_eq!(
            described(&o.sampler),
            described(&Sampler::ParentBased(Box::new(Sampler::AlwaysOn)))
        );
        assert_eq!(o.propagators, [Propagator::TraceContext, Propagator::Baggage]);
        assert!(o.problems.is_empty());
    }

    #[test]
    fn endpoints_follow_the_protocol() {
        let grpc = from(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")]);
        assert_eq!(grpc.otlp_endpoint.as_deref(), Some("http://collector:4317"));
        let http = from(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector:4318/"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ]);
        assert_eq!(http.protocol, Protocol::HttpProtobuf);
        assert_eq!(http.otlp_endpoint.as_deref(), Some("https://collector:4318/v1/traces"));
        // The signal's own variables win and are used as given.
        let own = from(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4318/custom"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
        ]);
        assert_eq!(own.protocol, Protocol::HttpProtobuf);
        assert_eq!(own.otlp_endpoint.as_deref(), Some("http://traces:4318/custom"));
        let off = from(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
            ("OTEL_TRACES_EXPORTER", "none"),
        ]);
        assert_eq!(off.otlp_endpoint, None);
        assert!(off.problems.is_empty());
    }

    #[test]
    fn an_unknown_protocol_exports_nothing_and_says_so() {
        let o = from(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ]);
        assert_eq!(o.otlp_endpoint, None);
        assert_eq!(o.problems.len(), 1, "{:?}", o.problems);
        assert!(
            o.problems[0].contains("OTEL_EXPORTER_OTLP_PROTOCOL=\"http/json\""),
            "{:?}",
            o.problems
        );
    }

    #[test]
    fn samplers_by_name_and_ratio() {
        let cases = [
            (
                "parentbased_traceidratio",
                Some("0.25"),
                Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(0.25))),
            ),
            ("traceidratio", Some("0.5"), Sampler::TraceIdRatioBased(0.5)),
            ("always_off", None, Sampler::AlwaysOff),
            ("always_on", None, Sampler::AlwaysOn),
            ("parentbased_always_off", None, Sampler::ParentBased(Box::new(Sampler::AlwaysOff))),
            ("ParentBased_Always_On", None, Sampler::ParentBased(Box::new(Sampler::AlwaysOn))),
        ];
        for (name, arg, want) in cases {
            let mut vars = vec![("OTEL_TRACES_SAMPLER", name)];
            vars.extend(arg.map(|a| ("OTEL_TRACES_SAMPLER_ARG", a)));
            let o = from(&vars);
            assert_eq!(described(&o.sampler), described(&want), "{name}");
            assert!(o.problems.is_empty(), "{name}: {:?}", o.problems);
        }
    }

    #[test]
    fn unknown_samplers_and_bad_ratios_fall_back_and_say_so() {
        let o = from(&[("OTEL_TRACES_SAMPLER", "jaeger_remote")]);
        assert_eq!(
            described(&o.sampler),
            described(&Sampler::ParentBased(Box::new(Sampler::AlwaysOn)))
        );
        assert!(o.problems[0].contains("jaeger_remote"), "{:?}", o.problems);
        let o = from(&[("OTEL_TRACES_SAMPLER", "traceidratio"), ("OTEL_TRACES_SAMPLER_ARG", "2")]);
        assert_eq!(described(&o.sampler), described(&Sampler::TraceIdRatioBased(1.0)));
        assert!(o.problems[0].contains("OTEL_TRACES_SAMPLER_ARG=\"2\""), "{:?}", o.problems);
    }

    #[test]
    fn propagators_in_order_unknown_ones_reported() {
        let o = from(&[("OTEL_PROPAGATORS", "baggage, tracecontext")]);
        assert_eq!(o.propagators, [Propagator::Baggage, Propagator::TraceContext]);
        let o = from(&[("OTEL_PROPAGATORS", "none")]);
        assert!(o.propagators.is_empty() && o.problems.is_empty());
        let o = from(&[("OTEL_PROPAGATORS", "tracecontext,b3")]);
        assert_eq!(o.propagators, [Propagator::TraceContext]);
        assert!(o.problems[0].contains("\"b3\""), "{:?}", o.problems);
        // The composite lists its fields in no particular order.
        let mut fields: Vec<String> =
            from(&[]).text_map_propagator().fields().map(String::from).collect();
        fields.sort();
        assert_eq!(fields, ["baggage", "traceparent", "tracestate"]);
    }

    #[test]
    fn tls_files_come_from_the_traces_variables_first() {
        let o = from(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector:4317"),
            ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/etc/general-ca.pem"),
            ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "/etc/traces-ca.pem"),
            ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "/etc/client.pem"),
            ("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "/etc/client.key"),
        ]);
        let file = |var: &str, path: &str| Some(FileVar { var: var.into(), path: path.into() });
        assert_eq!(
            o.tls,
            TlsFiles {
                certificate: file("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "/etc/traces-ca.pem"),
                client_certificate: file(
                    "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
                    "/etc/client.pem"
                ),
                client_key: file("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "/etc/client.key"),
            }
        );
        assert!(o.problems.is_empty(), "{:?}", o.problems);
        assert!(!from(&[]).tls.any());
    }

    #[test]
    fn tls_files_for_a_plain_endpoint_are_reported_unused() {
        let o = from(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
            ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/etc/ca.pem"),
        ]);
        assert_eq!(o.problems.len(), 1, "{:?}", o.problems);
        assert!(o.problems[0].contains("OTEL_EXPORTER_OTLP_CERTIFICATE"), "{:?}", o.problems);
        assert!(o.problems[0].contains("not an https endpoint"), "{:?}", o.problems);
    }

    #[test]
    fn export_timeout_in_milliseconds_traces_first() {
        assert_eq!(from(&[]).export_timeout, Duration::from_secs(10));
        let o = from(&[
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
            ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "700"),
        ]);
        assert_eq!(o.export_timeout, Duration::from_millis(700));
        let o = from(&[("OTEL_EXPORTER_OTLP_TIMEOUT", "5s")]);
        assert_eq!(o.export_timeout, Duration::from_secs(10));
        assert!(o.problems[0].contains("OTEL_EXPORTER_OTLP_TIMEOUT=\"5s\""), "{:?}", o.problems);
    }
}
