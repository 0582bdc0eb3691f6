//! OTLP export over TLS from a real service: the `shelfsync-storage` binary
//! applies one command with its traces going to an in-process receiver
//! (`shelfsync_tests::otlp`) on `https://127.0.0.1:PORT`, whose certificate
//! a private CA made for the test signed — over gRPC and over
//! HTTP/protobuf.
//!
//! - With the CA in `OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE` (the traces
//!   variable wins) the storage spans of that command arrive, every one with
//!   the build's `service.version` on its resource (and its git revision
//!   when the build knew it), besides what `OTEL_RESOURCE_ATTRIBUTES` adds;
//!   with a client certificate too, a receiver that requires one gets
//!   exactly it.
//! - Without the CA the handshake fails (the receiver sees it refused), the
//!   commands are applied all the same, the failure is in the service's
//!   log, and SIGTERM still stops the service promptly — also when spans
//!   are still queued then and the last flush meets the refusal.
//! - A CA file that cannot be used stops the start, naming the variable and
//!   the path.

use std::path::{Path, PathBuf};
use std::process::{Child, Command as Process, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use shelfsync_settings::Settings;
use shelfsync_testkit::TestEnv;
use shelfsync_tests::otlp::{ReceivedSpan, TlsReceiver, Wire, der_of};
use shelfsync_tests::*;

/// Long enough for a failing export to give up (10 s by default) and be
/// logged.
const LOG_WAIT: Duration = Duration::from_secs(40);
/// SIGTERM to exit: the exporter's flush is bounded (a few seconds).
const STOP_WAIT: Duration = Duration::from_secs(20);

/// The test's certificates: the collector's, signed by `ca`; a client
/// certificate signed by the same CA; and another CA that signed nothing
/// the collector shows.
struct Certs {
    _dir: tempfile::TempDir,
    _other_dir: tempfile::TempDir,
    ca: String,
    cert: String,
    key: String,
    client_cert: String,
    client_key: String,
    other_ca: String,
}

fn certs() -> Certs {
    let (dir, ca, cert, key) = test_certificates();
    let (client_cert, client_key) = test_client_certificate(dir.path());
    let (other_dir, other_ca, _, _) = test_certificates();
    Certs { _dir: dir, _other_dir: other_dir, ca, cert, key, client_cert, client_key, other_ca }
}

/// The real storage binary with the test's settings and `otel` variables
/// (nothing else inherited), its log in a file.
struct Storage {
    child: Child,
    log: PathBuf,
}

impl Storage {
    fn start(settings: &Settings, otel: &[(&str, &str)], log: &Path) -> Storage {
        let bin = shelfsync_testkit::workspace_bin("shelfsync-storage").expect("storage binary");
        let child = Process::new(bin)
            .env_clear()
            .envs(settings_env(settings))
            .envs(otel.iter().copied())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).expect("log file"))
            .spawn()
            .expect("spawning shelfsync-storage");
        Storage { child, log: log.to_path_buf() }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for the process to exit on its own.
    async fn exited(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "storage still running after {within:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGTERM, then how it exited and how long that took.
    async fn stop(&mut self) -> (ExitStatus, Duration) {
        let asked = Instant::now();
        signal(self.child.id(), "TERM");
        let status = self.exited(STOP_WAIT).await;
        (status, asked.elapsed())
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The variables that point the exporter at `receiver`, spans sent soon
/// after they end, plus `extra`.
fn otel_vars<'a>(
    receiver: &'a TlsReceiver,
    endpoint: &'a str,
    extra: &[(&'a str, &'a str)],
) -> Vec<(&'a str, &'a str)> {
    let mut vars = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", receiver.wire().protocol()),
        ("OTEL_BSP_SCHEDULE_DELAY", "200"),
        // As the deployments set them; a version given here loses to the
        // build's own.
        ("OTEL_RESOURCE_ATTRIBUTES", "k8s.pod.name=storage-0,service.version=9.9.9"),
    ];
    vars.extend_from_slice(extra);
    vars
}

/// Storage running against fresh servers, one command applied through it.
struct Applied {
    _env: TestEnv,
    h: Harness,
    _logs: tempfile::TempDir,
    storage: Storage,
    prefix: String,
}

async fn apply_one_command(otel: &[(&str, &str)]) -> Applied {
    let env = TestEnv::start().await.expect("servers");
    let settings = storage_settings(&env);
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let logs = tempfile::tempdir().expect("tmp");
    let storage = Storage::start(&settings, otel, &logs.path().join("storage.log"));
    h.send(vec![patch(7, 1, "tls", &product("t", 1, 1), 0)]).await.expect("send");
    h.wait_settled().await;
    assert_eq!(h.changes().await.expect("changes").len(), 1, "storage applied the command");
    Applied { _env: env, h, _logs: logs, storage, prefix: settings.nats.prefix }
}

/// The storage spans one applied command makes.
fn storage_spans(prefix: &str) -> [ReceivedSpan; 2] {
    let span = |name: String| ReceivedSpan { service: "shelfsync-storage".into(), name };
    [
        span(format!("process {prefix}.cmd.{{partition}}")),
        span(format!("send {prefix}.changes.{{brand_id}}.{{place_id}}")),
    ]
}

/// Applies a command with `tls` variables and checks its spans arrive
/// over TLS; returns the receiver for more checks.
async fn spans_arrive(mut receiver: TlsReceiver, tls: &[(&str, &str)]) -> TlsReceiver {
    let endpoint = receiver.endpoint();
    let mut run = apply_one_command(&otel_vars(&receiver, &endpoint, tls)).await;
    let wanted = storage_spans(&run.prefix);
    let got = receiver.spans_until(SETTLE, |got| wanted.iter().all(|w| got.contains(w))).await;
    for w in &wanted {
        assert!(got.contains(w), "{w:?} did not arrive; got {got:#?}\nlog:\n{}", run.storage.log());
    }
    assert!(receiver.failed_handshakes().is_empty(), "{:?}", receiver.failed_handshakes());
    let resources = receiver.resources();
    assert!(!resources.is_empty());
    for resource in &resources {
        let get = |key: &str| resource.get(key).map(String::as_str);
        assert_eq!(get("service.name"), Some("shelfsync-storage"), "{resource:?}");
        assert_eq!(get("service.version"), Some(env!("CARGO_PKG_VERSION")), "{resource:?}");
        assert_eq!(get("vcs.ref.head.revision"), shelfsync_telemetry::REVISION, "{resource:?}");
        assert_eq!(get("k8s.pod.name"), Some("storage-0"), "{resource:?}");
    }
    let (status, took) = run.storage.stop().await;
    assert!(status.success(), "{status:?}\nlog:\n{}", run.storage.log());
    eprintln!("{:?}: spans arrived; stopped in {took:?}", receiver.wire());
    receiver
}

/// Without the CA: refused handshakes, the service unaffected (it goes on
/// applying commands after the failure), the failure logged, a prompt stop.
async fn untrusted_collector(wire: Wire) {
    let c = certs();
    let mut receiver = TlsReceiver::start(wire, &c.cert, &c.key, None).await.expect("receiver");
    let endpoint = receiver.endpoint();
    let mut run = apply_one_command(&otel_vars(&receiver, &endpoint, &[])).await;
    eventually(SETTLE, "the exporter to try a handshake", || async {
        !receiver.failed_handshakes().is_empty()
    })
    .await;
    eventually(LOG_WAIT, "the failed export in the log", || async {
        run.storage.log().contains("OTLP export failed")
    })
    .await;
    let log = run.storage.log();
    assert!(log.contains(&endpoint), "the log names the endpoint:\n{log}");
    assert!(log.contains("OTEL_EXPORTER_OTLP_CERTIFICATE"), "the log hints at the CA:\n{log}");
    run.h.send(vec![patch(7, 2, "after", &product("a", 2, 1), 0)]).await.expect("send");
    run.h.wait_settled().await;
    assert_eq!(run.h.changes().await.expect("changes").len(), 2, "storage carried on");
    let got = receiver.spans_until(Duration::from_millis(200), |_| false).await;
    assert!(got.is_empty(), "nothing gets through an untrusted handshake: {got:?}");
    let (status, took) = run.storage.stop().await;
    assert!(status.success(), "{status:?}\nlog:\n{}", run.storage.log());
    eprintln!(
        "{wire:?}: handshakes refused: {:?}; stopped in {took:?}",
        receiver.failed_handshakes()
    );
}

/// Without the CA, with spans still queued at SIGTERM (nothing exported
/// before it): the last flush meets the refused handshake, says so, and
/// the service still exits promptly and cleanly.
async fn untrusted_collector_at_shutdown(wire: Wire) {
    let c = certs();
    let receiver = TlsReceiver::start(wire, &c.cert, &c.key, None).await.expect("receiver");
    let endpoint = receiver.endpoint();
    let mut vars = otel_vars(&receiver, &endpoint, &[]);
    // No export before the stop: the spans are all queued then.
    vars.retain(|(k, _)| *k != "OTEL_BSP_SCHEDULE_DELAY");
    vars.push(("OTEL_BSP_SCHEDULE_DELAY", "600000"));
    let mut run = apply_one_command(&vars).await;
    assert!(receiver.failed_handshakes().is_empty(), "an export before the stop");
    let (status, took) = run.storage.stop().await;
    let log = run.storage.log();
    assert!(status.success(), "{status:?}\nlog:\n{log}");
    assert!(!receiver.failed_handshakes().is_empty(), "the last flush was not tried");
    assert!(log.contains("OTLP export failed"), "the failed flush is not logged:\n{log}");
    eprintln!("{wire:?}: queued spans refused at the stop; stopped in {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_spans_reach_a_collector_signed_by_a_private_ca() {
    let c = certs();
    let receiver = TlsReceiver::start(Wire::Grpc, &c.cert, &c.key, None).await.expect("receiver");
    spans_arrive(receiver, &[("OTEL_EXPORTER_OTLP_CERTIFICATE", &c.ca)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_spans_reach_a_collector_signed_by_a_private_ca() {
    let c = certs();
    let receiver =
        TlsReceiver::start(Wire::HttpProtobuf, &c.cert, &c.key, None).await.expect("receiver");
    // The traces variable wins: the general one names a CA that did not
    // sign the collector's certificate.
    let tls = [
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", c.other_ca.as_str()),
        ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", c.ca.as_str()),
    ];
    spans_arrive(receiver, &tls).await;
}

/// A collector that requires a client certificate gets the configured one.
async fn client_certificate_is_shown(wire: Wire) {
    let c = certs();
    let receiver = TlsReceiver::start(wire, &c.cert, &c.key, Some(&c.ca)).await.expect("receiver");
    let tls = [
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", c.ca.as_str()),
        ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", c.client_cert.as_str()),
        ("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", c.client_key.as_str()),
    ];
    let receiver = spans_arrive(receiver, &tls).await;
    let shown = receiver.client_certificates();
    let client = der_of(&c.client_cert).expect("client certificate");
    assert!(!shown.is_empty());
    assert!(shown.iter().all(|s| s.as_ref() == Some(&client)), "{} connections", shown.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_shows_the_client_certificate_to_a_collector_that_requires_one() {
    client_certificate_is_shown(Wire::Grpc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_shows_the_client_certificate_to_a_collector_that_requires_one() {
    client_certificate_is_shown(Wire::HttpProtobuf).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_without_the_ca_the_handshake_fails_and_storage_carries_on() {
    untrusted_collector(Wire::Grpc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_without_the_ca_the_handshake_fails_and_storage_carries_on() {
    untrusted_collector(Wire::HttpProtobuf).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_without_the_ca_queued_spans_do_not_hold_up_the_stop() {
    untrusted_collector_at_shutdown(Wire::Grpc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_without_the_ca_queued_spans_do_not_hold_up_the_stop() {
    untrusted_collector_at_shutdown(Wire::HttpProtobuf).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_file_that_cannot_be_used_stops_the_start() {
    let dir = tempfile::tempdir().expect("tmp");
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate\n").expect("write");
    let missing = dir.path().join("missing.pem").display().to_string();
    let garbage = garbage.display().to_string();
    let folder = dir.path().display().to_string();
    let cases = [
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", missing.as_str(), "cannot be read"),
        ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", garbage.as_str(), "no PEM certificate"),
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", folder.as_str(), "cannot be read"),
        ("OTEL_EXPORTER_OTLP_CLIENT_KEY", garbage.as_str(), "without its pair"),
    ];
    // Nothing listens there: the start must fail before any connection.
    let mut settings = Settings::default();
    settings.nats.url = "nats://127.0.0.1:9".into();
    settings.redis.url = "redis://127.0.0.1:9".into();
    for (var, path, why) in cases {
        let log = dir.path().join("storage.log");
        let otel = [("OTEL_EXPORTER_OTLP_ENDPOINT", "https://127.0.0.1:9"), (var, path)];
        let mut storage = Storage::start(&settings, &otel, &log);
        let status = storage.exited(STOP_WAIT).await;
        let said = storage.log();
        assert!(!status.success(), "{var}={path}: started anyway\n{said}");
        assert!(said.contains(&format!("{var}={path}")), "{var}={path} not named:\n{said}");
        assert!(said.contains(why), "{why:?} not said:\n{said}");
    }
}
