//! The peer's SQL: one schema per variant (an `offers` table keyed by brand, place and product
//! id, and an `outbox` of change events), the per-batch statements and the verification
//! queries. Pure text; `load` and `verify` run it.

/// How the offers table is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// What one writes first: a `jsonb` payload, the default fillfactor (100).
    Default,
    /// A `text` payload (compared byte for byte, no jsonb parse on the way in) and fillfactor 50,
    /// so that the generation stamp of an unchanged row is a HOT update on the same page.
    Tuned,
}

impl Variant {
    pub const ALL: [Variant; 2] = [Variant::Default, Variant::Tuned];

    pub fn name(self) -> &'static str {
        match self {
            Variant::Default => "default",
            Variant::Tuned => "tuned",
        }
    }

    /// The schema holding this variant's tables.
    pub fn schema(self) -> &'static str {
        match self {
            Variant::Default => "peer_default",
            Variant::Tuned => "peer_tuned",
        }
    }

    pub fn payload_type(self) -> &'static str {
        match self {
            Variant::Default => "jsonb",
            Variant::Tuned => "text",
        }
    }

    pub fn fillfactor(self) -> u32 {
        match self {
            Variant::Default => 100,
            Variant::Tuned => 50,
        }
    }

    /// `payload_type`, fillfactor: what the report says of the variant.
    pub fn describe(self) -> String {
        format!("{} payload, fillfactor {}", self.payload_type(), self.fillfactor())
    }
}

/// Drops and creates the variant's schema: the tables start empty.
pub fn create_schema(v: Variant) -> String {
    let (s, ty, ff) = (v.schema(), v.payload_type(), v.fillfactor());
    format!(
        "DROP SCHEMA IF EXISTS {s} CASCADE;
CREATE SCHEMA {s};
CREATE TABLE {s}.offers (
    brand bigint NOT NULL,
    place bigint NOT NULL,
    product_id text NOT NULL,
    payload {ty} NOT NULL,
    generation bigint NOT NULL,
    updated_at timestamptz NOT NULL,
    PRIMARY KEY (brand, place, product_id)
) WITH (fillfactor = {ff});
CREATE TABLE {s}.outbox (
    seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    brand bigint NOT NULL,
    place bigint NOT NULL,
    product_id text NOT NULL,
    generation bigint NOT NULL,
    before {ty},
    after {ty} NOT NULL
);"
    )
}

/// The one statement of a batch. `$1` brand, `$2` generation, `$3` places, `$4` product ids,
/// `$5` payloads (text; cast to the variant's type). It locks the batch's current rows
/// (their before images), upserts only the rows whose payload is distinct from the new one
/// (`updated_at` moves only there) and writes one outbox event per such row. Returns
/// (rows upserted, events written).
pub fn upsert(v: Variant) -> String {
    let (s, ty) = (v.schema(), v.payload_type());
    format!(
        "WITH input AS (
    SELECT * FROM unnest($3::bigint[], $4::text[], $5::text[]) AS i(place, product_id, payload)
), current AS (
    SELECT o.place, o.product_id, o.payload
    FROM {s}.offers o JOIN input i ON o.brand = $1 AND o.place = i.place AND o.product_id = i.product_id
    FOR UPDATE OF o
), changed AS (
    SELECT i.place, i.product_id, i.payload::{ty} AS after, c.payload AS before
    FROM input i LEFT JOIN current c ON c.place = i.place AND c.product_id = i.product_id
    WHERE c.payload IS DISTINCT FROM i.payload::{ty}
), upserted AS (
    INSERT INTO {s}.offers AS o (brand, place, product_id, payload, generation, updated_at)
    SELECT $1, place, product_id, after, $2, now() FROM changed
    ON CONFLICT (brand, place, product_id) DO UPDATE
        SET payload = EXCLUDED.payload, generation = EXCLUDED.generation, updated_at = EXCLUDED.updated_at
    RETURNING 1
), events AS (
    INSERT INTO {s}.outbox (brand, place, product_id, generation, before, after)
    SELECT $1, place, product_id, $2, before, after FROM changed
    RETURNING 1
)
SELECT (SELECT count(*) FROM upserted), (SELECT count(*) FROM events)"
    )
}

/// The second statement of a batch: the generation stamp of the batch's rows the upsert left
/// alone (those already stamped are the upserted ones). `$1` brand, `$2` generation, `$3`
/// places, `$4` product ids.
pub fn stamp(v: Variant) -> String {
    let s = v.schema();
    format!(
        "UPDATE {s}.offers AS o SET generation = $2
FROM unnest($3::bigint[], $4::text[]) AS i(place, product_id)
WHERE o.brand = $1 AND o.place = i.place AND o.product_id = i.product_id AND o.generation <> $2"
    )
}

/// Untimed, before each import: what a maintained table looks like, and no checkpoint of the
/// previous import's writes inside the timing.
pub fn maintenance(v: Variant) -> Vec<String> {
    let s = v.schema();
    vec![
        format!("VACUUM (ANALYZE) {s}.offers"),
        format!("VACUUM (ANALYZE) {s}.outbox"),
        "CHECKPOINT".into(),
    ]
}

/// Rows, and rows not stamped with `$1`.
pub fn count_stamps(v: Variant) -> String {
    format!("SELECT count(*), count(*) FILTER (WHERE generation <> $1) FROM {}.offers", v.schema())
}

/// Keys whose `updated_at` moved past `$1`.
pub fn moved_keys(v: Variant) -> String {
    format!("SELECT place, product_id FROM {}.offers WHERE updated_at > $1", v.schema())
}

/// Events of generation `$1`, and how many of them have no before image (new rows).
pub fn count_events(v: Variant) -> String {
    format!(
        "SELECT count(*), count(*) FILTER (WHERE before IS NULL) FROM {}.outbox WHERE generation = $1",
        v.schema()
    )
}

/// After verification: the outbox is drained, as a relay that has published it would.
pub fn drain_outbox(v: Variant) -> String {
    format!("TRUNCATE {}.outbox", v.schema())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_differ_in_payload_type_and_fillfactor_only() {
        let d = create_schema(Variant::Default);
        let t = create_schema(Variant::Tuned);
        assert!(d.contains("payload jsonb NOT NULL") && d.contains("fillfactor = 100"), "{d}");
        assert!(t.contains("payload text NOT NULL") && t.contains("fillfactor = 50"), "{t}");
        assert!(d.contains("PRIMARY KEY (brand, place, product_id)"));
        let renamed = d
            .replace("peer_default", "peer_tuned")
            .replace("jsonb", "text")
            .replace("fillfactor = 100", "fillfactor = 50");
        assert_eq!(renamed, t);
    }

    #[test]
    fn the_batch_statement_locks_compares_upserts_and_emits() {
        let sql = upsert(Variant::Default);
        // One statement: the before images are locked rows of the same snapshot.
        assert_eq!(sql.matches(';').count(), 0);
        assert!(sql.contains("FOR UPDATE OF o"), "{sql}");
        assert!(sql.contains("WHERE c.payload IS DISTINCT FROM i.payload::jsonb"), "{sql}");
        assert!(sql.contains("ON CONFLICT (brand, place, product_id) DO UPDATE"), "{sql}");
        assert!(sql.contains("INSERT INTO peer_default.outbox"), "{sql}");
        assert!(sql.contains("SELECT $1, place, product_id, $2, before, after FROM changed"));
        // updated_at only moves with the payload: it is set in the upsert and nowhere else.
        assert_eq!(sql.matches("updated_at").count(), 3);
        assert!(upsert(Variant::Tuned).contains("i.payload::text AS after"));
    }

    #[test]
    fn the_stamp_touches_only_the_generation_of_rows_not_yet_stamped() {
        let sql = stamp(Variant::Tuned);
        assert!(sql.starts_with("UPDATE peer_tuned.offers AS o SET generation = $2\n"), "{sql}");
        assert!(sql.ends_with("AND o.generation <> $2"), "{sql}");
        assert!(!sql.contains("updated_at") && !sql.contains("payload"), "{sql}");
    }

    #[test]
    fn maintenance_and_checks_name_the_variant_schema() {
        let m = maintenance(Variant::Tuned);
        assert_eq!(m.last().map(String::as_str), Some("CHECKPOINT"));
        assert!(m[..2].iter().all(|s| s.starts_with("VACUUM") && s.contains("peer_tuned.")));
        for sql in [count_stamps(Variant::Default), moved_keys(Variant::Default)] {
            assert!(sql.contains("FROM peer_default.offers"), "{sql}");
        }
        assert!(
            count_events(Variant::Default)
                .contains("FROM peer_default.outbox WHERE generation = $1")
        );
        assert_eq!(drain_outbox(Variant::Tuned), "TRUNCATE peer_tuned.outbox");
    }
}
