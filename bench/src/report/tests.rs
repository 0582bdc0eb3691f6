use super::*;

fn row(scenario: &str, system: &str, rps: f64, changes: u64) -> ImportRow {
    ImportRow {
        scenario: scenario.into(),
        system: system.into(),
        records: 1000,
        raw_bytes: 240_000,
        records_per_s: rps,
        changes,
        expected_changes: changes,
        // 1% of 1000 records at 400 bytes each: 1.67% of the raw bytes.
        change_bytes: changes * 400,
        out_over_in: changes as f64 * 400.0 / 240_000.0,
        ..Default::default()
    }
}

/// The peer's targets: ratios of the same imports in the same run, judged
/// only on durable servers; an unverified peer figure is not measured.
#[test]
fn peer_targets_are_same_run_ratios_on_durable_servers() {
    let ours = |s: &str, rps: f64, ingest: f64, writes: u64| ImportRow {
        ingest_cpu_s_per_m: ingest,
        redis_writes: writes,
        ..row(s, "shelfsync", rps, 0)
    };
    let peer = |s: &str, v: &str, rps: Option<f64>| PeerImportRow {
        scenario: s.into(),
        variant: v.into(),
        records_per_s: rps,
        ..Default::default()
    };
    let report = |churn: f64, tuned_initial: Option<f64>, durable: bool| {
        let mut r = Report {
            durable,
            imports: vec![
                ours(INITIAL, 120.0, 1.0, 1000),
                ours(IDENTICAL, 500.0, 1.2, 5),
                ours(CHURN, churn, 2.9, 20),
            ],
            parse_floor: Some(ParseFloor { cpu_s_per_m: 1.0, ..Default::default() }),
            postgres: Some(PostgresPeer {
                imports: vec![
                    peer(CHURN, "default", Some(100.0)),
                    peer(INITIAL, "tuned", tuned_initial),
                    peer(IDENTICAL, "tuned", Some(200.0)),
                    peer(CHURN, "tuned", Some(150.0)),
                ],
                ..Default::default()
            }),
            redis_memory: Some(RedisMemory { bytes_per_record: 250.0, ..Default::default() }),
            ..Default::default()
        };
        r.finish(Duration::from_secs(1));
        r
    };
    let holds = |r: &Report, name: &str| {
        r.targets.iter().find(|t| t.target.starts_with(name)).expect(name).holds
    };
    let good = report(310.0, Some(100.0), true);
    assert_eq!(holds(&good, "1% churn re-import ≥ 3× PostgreSQL default"), Some(true));
    assert_eq!(holds(&good, "ahead of PostgreSQL tuned"), Some(true));
    assert_eq!(holds(&good, "ingest CPU per record ≤ 3×"), Some(true));
    assert_eq!(holds(&good, "identical re-import writes ≤ 1%"), Some(true));
    assert_eq!(holds(&good, "Redis memory ≤ 280"), Some(true));
    let short = report(290.0, Some(130.0), true);
    assert_eq!(holds(&short, "1% churn re-import ≥ 3× PostgreSQL default"), Some(false));
    assert_eq!(holds(&short, "ahead of PostgreSQL tuned"), Some(false), "initial 0.92×");
    let volatile = report(310.0, Some(100.0), false);
    assert_eq!(holds(&volatile, "1% churn re-import ≥ 3× PostgreSQL default"), None);
    // A NATS cluster does not fsync: not the target's conditions either.
    let mut cluster = report(310.0, Some(100.0), true);
    cluster.nats_cluster = true;
    cluster.finish(Duration::from_secs(1));
    assert_eq!(holds(&cluster, "1% churn re-import ≥ 3× PostgreSQL default"), None);
    let unverified = report(310.0, None, true);
    assert_eq!(holds(&unverified, "ahead of PostgreSQL tuned"), None);
}

#[test]
fn targets_compare_against_the_same_run_floor() {
    let mut r = Report {
        imports: vec![
            row("identical re-import", "shelfsync", 100.0, 0),
            row("re-import, 1% churn", "shelfsync", 60.0, 10),
            row("re-import, 1% churn", "floor", 100.0, 0),
            row("re-import, 1% churn", "naive", 50.0, 1000),
        ],
        ..Default::default()
    };
    r.link_floor();
    r.finish(Duration::from_secs(1));
    let t = |name: &str| r.targets.iter().find(|t| t.target.starts_with(name)).expect(name);
    assert_eq!(t("re-import with 1% churn").holds, Some(true));
    assert!(t("re-import with 1% churn").measured.starts_with("60%"));
    assert_eq!(t("identical re-import").holds, Some(true));
    assert_eq!(t("change bytes out").holds, Some(true));
    assert_eq!(t("freshness").holds, None);

    let md = r.markdown();
    assert!(md.contains("| re-import, 1% churn | shelfsync | 60.0 |"), "{md}");
    assert!(md.contains("naive / shelfsync"), "{md}");
    assert!(md.contains("| 100× |") || md.contains("100×"), "{md}");
}

fn peer_row(scenario: &str, variant: &str, rate: Option<f64>) -> PeerImportRow {
    PeerImportRow {
        scenario: scenario.into(),
        variant: variant.into(),
        layout: format!("{variant} layout"),
        connections: 4,
        records: 1000,
        records_per_s: rate,
        problems: if rate.is_some() { Vec::new() } else { vec!["3 rows not stamped".into()] },
        ..Default::default()
    }
}

#[test]
fn the_postgres_table_sets_shelfsync_against_each_variant() {
    let r = Report {
        durable: true,
        imports: vec![row("initial import", "shelfsync", 300.0, 1000)],
        postgres: Some(PostgresPeer {
            connections: 4,
            probe: vec![peer_row("initial import", "default", Some(50.0))],
            imports: vec![
                peer_row("initial import", "default", Some(100.0)),
                peer_row("identical re-import", "default", None),
                peer_row("initial import", "tuned", Some(150.0)),
                peer_row("identical re-import", "tuned", Some(120.0)),
            ],
            ..Default::default()
        }),
        parse_floor: Some(ParseFloor { records_per_s: 4000.0, ..Default::default() }),
        ..Default::default()
    };
    let md = r.markdown();
    assert!(md.contains("| initial import | 300 | 100 | 3.00× | 150 | 2.00× |"), "{md}");
    assert!(md.contains("### PostgreSQL peer, durable"), "{md}");
    assert!(!md.contains("volatile"), "{md}");
    assert!(
        md.contains("| identical re-import | — | **failed verification** | — | 120 | — |"),
        "{md}"
    );
    // One line per import kind, whatever the order of the peer's rows.
    assert_eq!(md.matches("| initial import | 300 |").count(), 1, "{md}");
    assert!(md.contains("**NO**: 3 rows not stamped"), "{md}");
    assert!(md.contains("4 → 50.0; kept 4"), "{md}");
    assert!(md.contains("Parse floor") && md.contains("4000 records/s"), "{md}");
    assert_eq!(r.postgres.as_ref().map(|p| p.failures().len()), Some(1));
}

#[test]
fn aof_rewrites_during_an_import_are_listed_with_their_cpu() {
    let quiet = Report {
        imports: vec![row("identical re-import", "shelfsync", 300.0, 0)],
        ..Default::default()
    };
    assert!(!quiet.markdown().contains("AOF rewrites"), "{}", quiet.markdown());
    let r = Report {
        imports: vec![ImportRow {
            aof_rewrites: 3,
            redis_children_cpu_s_per_m: 1.74,
            ..row("initial import", "shelfsync", 300.0, 1000)
        }],
        ..Default::default()
    };
    let md = r.markdown();
    assert!(md.contains("initial import / shelfsync: 3 (1.74 CPU s / 1M)"), "{md}");
    assert!(r.imports[0].summary().ends_with("3 AOF rewrites (1.74 CPU s / 1M)"));
}

#[test]
fn a_slow_churn_import_misses_its_target() {
    let mut r = Report {
        imports: vec![
            row("re-import, 1% churn", "shelfsync", 40.0, 10),
            row("re-import, 1% churn", "floor", 100.0, 0),
        ],
        ..Default::default()
    };
    r.link_floor();
    r.finish(Duration::from_secs(1));
    assert_eq!(r.targets[0].holds, Some(false));
    assert!(r.markdown().contains("**NO**"));
}
