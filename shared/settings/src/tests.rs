//! Loading and validating settings: layers, overrides, errors, redaction
//! and the config files shipped in config/.

use std::path::Path;
use std::time::Duration;

use super::*;
use crate::load::env_key_path;

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

#[test]
fn defaults_are_valid() {
    let s = Settings::load_from(None, &[]).expect("defaults");
    assert_eq!(s.nats.prefix, "shelfsync");
    assert_eq!(s.storage.partitions, 64);
    assert_eq!(s.storage.owned_partitions().len(), 64);
    assert_eq!(s.ingest.import_lease_ttl, Duration::from_secs(30));
}

#[test]
fn file_then_env_overrides() {
    let dir = std::env::temp_dir().join(format!("ss-settings-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let path = dir.join("c.toml");
    std::fs::write(
        &path,
        r#"
[nats]
url = "nats://a:4222"
prefix = "demo"
[storage]
partitions = 8
[[partners]]
name = "flowers"
brand_id = 7
kind = "full"
fields = ["price", "stock"]
poll_interval = "5m"
source = "https://partner.example/feed.json"
"#,
    )
    .expect("write");
    let s = Settings::load_from(
        Some(&path),
        &env(&[
            ("NATS_URL", "nats://b:4222"),
            ("SHELFSYNC__STORAGE__REPLICAS", "2"),
            ("SHELFSYNC__STORAGE__REPLICA", "1"),
            ("SHELFSYNC__REDIS__NAMESPACE", "x"),
            ("SHELFSYNC__INGEST__IMPORT_LEASE_TTL", "2s"),
            ("UNRELATED", "1"),
        ]),
    )
    .expect("load");
    assert_eq!(s.nats.url, "nats://b:4222");
    assert_eq!(s.nats.prefix, "demo");
    assert_eq!(s.redis.namespace, "x");
    assert_eq!(s.ingest.import_lease_ttl, Duration::from_secs(2));
    assert_eq!(s.storage.owned_partitions(), vec![1, 3, 5, 7]);
    let p = s.partner("flowers").expect("partner");
    assert_eq!(p.kind, ImportKind::Full);
    assert_eq!(p.poll_interval, Some(Duration::from_secs(300)));
    assert!(p.clear_missing);

    // SHELFSYNC__ wins over NATS_URL.
    let s = Settings::load_from(
        None,
        &env(&[("NATS_URL", "nats://b:4222"), ("SHELFSYNC__NATS__URL", "nats://c:4222")]),
    )
    .expect("load");
    assert_eq!(s.nats.url, "nats://c:4222");
}

#[test]
fn later_files_override_earlier_ones() {
    let dir = std::env::temp_dir().join(format!("ss-settings-layers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let common = dir.join("common.toml");
    let own = dir.join("storage.toml");
    let partners = dir.join("partners.toml");
    std::fs::write(
        &common,
        "[nats]\nurl = \"nats://common:4222\"\nprefix = \"demo\"\n[storage]\npartitions = 8\nkeyframes_kept = 3\n",
    )
    .expect("write");
    std::fs::write(&own, "[storage]\nreplicas = 4\nkeyframes_kept = 5\n").expect("write");
    std::fs::write(&partners, "[[partners]]\nname = \"flowers\"\nbrand_id = 7\nkind = \"full\"\n")
        .expect("write");
    let s = Settings::load_files_from(
        &[&common, &own, &partners],
        &env(&[("SHELFSYNC__STORAGE__REPLICA", "3")]),
    )
    .expect("layers");
    // Kept from the first file, overridden key by key by the second, the
    // environment last.
    assert_eq!(s.nats.url, "nats://common:4222");
    assert_eq!(s.nats.prefix, "demo");
    assert_eq!(s.storage.partitions, 8);
    assert_eq!(s.storage.replicas, 4);
    assert_eq!(s.storage.keyframes_kept, 5);
    assert_eq!(s.storage.owned_partitions(), vec![3, 7]);
    assert_eq!(s.partners.len(), 1);
    // The order matters: the common file last puts its value back.
    let s = Settings::load_files_from(&[&own, &common], &[]).expect("reversed");
    assert_eq!(s.storage.keyframes_kept, 3);
    assert_eq!(s.storage.replicas, 4);
    // The single-file API is the one-element case.
    let one = Settings::load_from(Some(&common), &[]).expect("one file");
    assert_eq!(one.storage.keyframes_kept, 3);
    assert_eq!(one.storage.replicas, 1);
    // An array (the partners) is replaced whole, never merged item by item.
    let more = dir.join("more-partners.toml");
    std::fs::write(
        &more,
        "[[partners]]\nname = \"prices\"\nbrand_id = 8\nkind = \"delta\"\nfields = [\"price\"]\n",
    )
    .expect("write");
    let s = Settings::load_files_from(&[&partners, &more], &[]).expect("partners twice");
    let names: Vec<&str> = s.partners.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["prices"]);
    assert_eq!(s.partners[0].fields, ["price"]);
    // A missing file anywhere in the list is an error naming it.
    let err = Settings::load_files_from(&[common.clone(), dir.join("nope.toml")], &[])
        .expect_err("missing")
        .to_string();
    assert!(err.contains("nope.toml"), "{err}");
}

#[test]
fn bad_values_have_clear_errors() {
    let cases = [
        ("[storage]\nreplica = 3\nreplicas = 2", "storage.replica"),
        ("[nats]\nprefix = \"a.>\"", "nats.prefix"),
        ("[storage]\npartitions = 0", "storage.partitions"),
        (
            "[[partners]]\nname = \"x\"\nbrand_id = 1\nkind = \"full\"\nfields = [\"colour\"]",
            "unknown field `colour`",
        ),
        ("[[partners]]\nname = \"x\"\nbrand_id = 1\nkind = \"sometimes\"", "sometimes"),
        ("[storage]\npartitions = \"many\"", "partitions"),
        ("[storage]\ntombstone_ttl = \"soon\"", "tombstone_ttl"),
        ("[storage]\nkeyframe_schedule = \"nightly\"", "keyframe_schedule"),
        ("[[validator.rules]]\nname = \"x\"\nkind = \"sometimes\"", "sometimes"),
        (
            "[[validator.rules]]\nname = \"j\"\nkind = \"price_jump\"\nmax_drop_pct = -1",
            "max_drop_pct",
        ),
        (
            "[[aggregator.places]]\nbrand_id = 1\nplace_id = 2\nregion = \"a\"\n[[aggregator.places]]\nbrand_id = 1\nplace_id = 2\nregion = \"b\"",
            "listed twice",
        ),
        ("[nats]\nurl = \"nats://x\"\nbogus = 1", "bogus"),
        (
            "[[partners]]\nname = \"x\"\nbrand_id = 1\nkind = \"full\"\npush_tokens_env = \"1-TOKENS\"",
            "partners[0].push_tokens_env",
        ),
        (
            "[[partners]]\nname = \"x\"\nbrand_id = 1\nkind = \"full\"\nmax_push_bytes = 0",
            "partners[0].max_push_bytes",
        ),
        ("[ingest]\nmax_push_bytes = 0", "ingest.max_push_bytes"),
        // Tokens never come from the committed config itself.
        (
            "[[partners]]\nname = \"x\"\nbrand_id = 1\nkind = \"full\"\npush_tokens = [\"0123456789abcdef\"]",
            "unknown field `push_tokens`",
        ),
        ("[ingest]\nimport_lease_ttl = \"500ms\"", "ingest.import_lease_ttl"),
        (
            "[ingest]\ncompression = \"zstd\"",
            "ingest.compression: \"zstd\" is not one of \"lz4\", \"none\"",
        ),
    ];
    for (text, needle) in cases {
        let err = Settings::from_toml(text).expect_err(text).to_string();
        assert!(err.contains(needle), "error for {text:?} was {err:?}, expected {needle:?}");
    }
}

#[test]
fn push_keys_per_partner_with_the_ingest_default_limit() {
    let s = Settings::from_toml(
        r#"
[ingest]
max_push_bytes = 1000
[[partners]]
name = "a"
brand_id = 1
kind = "full"
push_tokens_file = "/run/secrets/a-push"
push_tokens_env = "A_PUSH_TOKENS"
max_push_bytes = 10
[[partners]]
name = "b"
brand_id = 1
kind = "delta"
"#,
    )
    .expect("valid");
    let (a, b) = (s.partner("a").expect("a"), s.partner("b").expect("b"));
    assert_eq!(a.push_tokens_file.as_deref(), Some(Path::new("/run/secrets/a-push")));
    assert_eq!(a.push_tokens_env.as_deref(), Some("A_PUSH_TOKENS"));
    assert!(a.push_enabled() && !b.push_enabled(), "no token source: push disabled");
    assert_eq!((a.push_limit(&s.ingest), b.push_limit(&s.ingest)), (10, 1000));
    assert_eq!(Settings::default().ingest.max_push_bytes, 256 << 20, "256 MiB by default");
}

#[test]
fn partner_keys_can_be_set_from_the_environment_by_index() {
    let dir = std::env::temp_dir().join(format!("ss-settings-idx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let path = dir.join("c.toml");
    std::fs::write(
        &path,
        "[[partners]]\nname = \"a\"\nbrand_id = 1\nkind = \"full\"\n\
         [[partners]]\nname = \"b\"\nbrand_id = 2\nkind = \"delta\"\n",
    )
    .expect("write");
    let s = Settings::load_from(
        Some(&path),
        &env(&[
            ("SHELFSYNC__PARTNERS__1__PUSH_TOKENS_ENV", "B_TOKENS"),
            ("SHELFSYNC__PARTNERS__1__MAX_PUSH_BYTES", "4096"),
            ("SHELFSYNC__PARTNERS[0]__PUSH_TOKENS_FILE", "/run/secrets/a"),
        ]),
    )
    .expect("load");
    let (a, b) = (s.partner("a").expect("a"), s.partner("b").expect("b"));
    assert_eq!((b.brand_id, b.kind), (2, ImportKind::Delta), "the rest of the entry stays");
    assert_eq!((b.push_tokens_env.as_deref(), b.max_push_bytes), (Some("B_TOKENS"), Some(4096)));
    assert_eq!(a.push_tokens_file.as_deref(), Some(Path::new("/run/secrets/a")));
    assert_eq!(env_key_path("STORAGE__PARTITIONS"), "storage.partitions");
    assert_eq!(env_key_path("PARTNERS__10__NAME"), "partners[10].name");
}

#[test]
fn urls_are_redacted_for_logs() {
    assert_eq!(redact_url("redis://app:s3cret@h:6379"), "redis://app:***@h:6379");
    assert_eq!(redact_url("redis://:s3cret@h:6379/0"), "redis://:***@h:6379/0");
    assert_eq!(redact_url("nats://tok@h:4222,nats://h2:4222"), "nats://***@h:4222,nats://h2:4222");
    assert_eq!(redact_url("redis://h:6379"), "redis://h:6379");
}

#[test]
fn missing_file_is_an_error() {
    let err = Settings::load_from(Some(Path::new("/nonexistent/x.toml")), &[])
        .expect_err("missing")
        .to_string();
    assert!(err.contains("does not exist"), "{err}");
}

#[test]
fn the_shipped_config_files_load() {
    // Each deployment's files as its workloads layer them (ingest.toml, the partners, joins
    // these once the partners' push token keys exist in the settings).
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    for files in [
        &["config/example.toml"][..],
        &["compose/config/shelfsync.toml", "compose/config/storage.toml"],
        &["k8s/base/config/shelfsync.toml", "k8s/base/config/storage.toml"],
    ] {
        let paths: Vec<_> = files.iter().map(|f| root.join(f)).collect();
        if let Err(e) = Settings::load_files_from(&paths, &[]) {
            panic!("{files:?}: {e}");
        }
    }
}
