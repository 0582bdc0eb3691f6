//! TLS to NATS switched on by config: a server that requires TLS, a client
//! that trusts the test CA, and storage running over it.

use shelfsync_testkit::{NatsServer, RedisServer};
use shelfsync_tests::*;

#[tokio::test]
async fn nats_over_tls_by_config() {
    let (_certs, ca, cert, key) = test_certificates();
    let nats = NatsServer::start_with_config(&format!(
        "tls {{\n  cert_file: \"{cert}\"\n  key_file: \"{key}\"\n  timeout: 2\n}}\n"
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

    settings.nats.tls_ca_file = Some(ca);
    let h = Harness::connect(settings.clone()).await.expect("harness over TLS");
    let _storage = InProcessStorage::start(settings).await.expect("storage over TLS");
    h.send(vec![patch(7, 1, "tls", &product("t", 1, 1), 0)]).await.expect("send");
    h.wait_settled().await;
    assert_eq!(h.changes().await.expect("changes").len(), 1);
}
