//! TLS to NATS switched on by config: a server that requires TLS, a client
//! that trusts the test CA, and storage running over it.

use std::path::Path;
use std::process::Command;

use shelfsync_testkit::{NatsServer, RedisServer};
use shelfsync_tests::*;

/// A throwaway CA and a server certificate for 127.0.0.1, made with the
/// `openssl` command line.
fn make_certs(dir: &Path) {
    let run = |args: &[&str]| {
        let out =
            Command::new("openssl").args(args).current_dir(dir).output().expect("openssl runs");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=shelfsync test CA",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    std::fs::write(dir.join("ext.cnf"), "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        .expect("ext");
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
}

#[tokio::test]
async fn nats_over_tls_by_config() {
    let certs = tempfile::tempdir().expect("tmp");
    make_certs(certs.path());
    let p = |f: &str| certs.path().join(f).display().to_string();
    let nats = NatsServer::start_with_config(&format!(
        "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  timeout: 2\n}}\n",
        p("server.pem"),
        p("server.key")
    ))
    .await
    .expect("nats with TLS");
    let redis = RedisServer::start().await.expect("redis");
    let mut settings = shelfsync_settings::Settings::default();
    settings.nats.url = nats.url();
    settings.nats.prefix = "tls".into();
    settings.redis.url = redis.url();
    settings.redis.namespace = "tls".into();
    settings.storage.partitions = 2;
    settings.storage.http_listen = "127.0.0.1:0".into();
    settings.storage.keyframe_schedule = String::new();

    // Without trusting the CA, the handshake fails: TLS is really on.
    settings.nats.tls_required = true;
    assert!(
        shelfsync_bus::connect(&settings.nats, "tls-test", false).await.is_err(),
        "an untrusted certificate must be refused"
    );

    settings.nats.tls_ca_file = Some(p("ca.pem"));
    let h = Harness::connect(settings.clone()).await.expect("harness over TLS");
    let _storage = InProcessStorage::start(settings).await.expect("storage over TLS");
    h.send(vec![patch(7, 1, "tls", &product("t", 1, 1), 0)]).await.expect("send");
    h.wait_settled().await;
    assert_eq!(h.changes().await.expect("changes").len(), 1);
}
