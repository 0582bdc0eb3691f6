//! Whether an import into the peer did what it must, from what its statements returned and
//! what the tables hold afterwards. A figure of an import that fails is not reported.

use std::collections::HashSet;

use super::rows::Key;

/// What an import must leave behind.
#[derive(Debug)]
pub struct Expected<'a> {
    /// Rows of the dump (the table holds exactly these keys).
    pub records: u64,
    /// Keys whose payload is new or different (the dumps' diff).
    pub changed: &'a HashSet<Key>,
    /// Keys the table did not have before.
    pub new_rows: u64,
    /// Changes the feed generator predicts for this import.
    pub feed_changes: u64,
}

/// What the statements returned and the tables hold after the import.
#[derive(Debug, Default)]
pub struct Observed {
    /// Rows the upserts wrote, and outbox events they wrote (the statements' counts).
    pub upserted: u64,
    pub events_written: u64,
    /// Rows the generation-only updates stamped.
    pub stamped: u64,
    /// Rows in the table, and rows not stamped with this import's generation.
    pub rows: u64,
    pub unstamped: u64,
    /// Keys whose `updated_at` moved during the import.
    pub moved: HashSet<Key>,
    /// Outbox events of this generation, and those of them without a before image.
    pub events: u64,
    pub events_without_before: u64,
}

/// Every way the import went wrong; empty when it is right.
pub fn problems(e: &Expected, o: &Observed) -> Vec<String> {
    let mut out = Vec::new();
    let mut check = |ok: bool, what: String| {
        if !ok {
            out.push(what);
        }
    };
    check(o.rows == e.records, format!("{} rows in the table, {} expected", o.rows, e.records));
    check(
        o.unstamped == 0,
        format!("{} rows not stamped with the import's generation", o.unstamped),
    );
    check(
        o.upserted + o.stamped == e.records,
        format!("{} upserted + {} stamped rows, the dump has {}", o.upserted, o.stamped, e.records),
    );
    check(
        o.events == e.feed_changes,
        format!("{} outbox events, the feeds predict {} changes", o.events, e.feed_changes),
    );
    check(
        o.events == o.events_written && o.events_written == o.upserted,
        format!(
            "{} events in the outbox, {} written, {} rows upserted",
            o.events, o.events_written, o.upserted
        ),
    );
    check(
        o.events_without_before == e.new_rows,
        format!(
            "{} events without a before image, {} new rows",
            o.events_without_before, e.new_rows
        ),
    );
    let stray = o.moved.difference(e.changed).count();
    let missed = e.changed.difference(&o.moved).count();
    if stray > 0 || missed > 0 {
        let sample = o.moved.symmetric_difference(e.changed).next();
        out.push(format!(
            "updated_at moved on {stray} rows whose data did not change and not on {missed} that did (e.g. {sample:?})"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(ids: &[&str]) -> HashSet<Key> {
        ids.iter().map(|id| (1, id.to_string())).collect()
    }

    /// A churn import of 10 rows of which "a" and "b" changed, done right.
    fn right(changed: &HashSet<Key>) -> (Expected<'_>, Observed) {
        let e = Expected { records: 10, changed, new_rows: 0, feed_changes: 2 };
        let o = Observed {
            upserted: 2,
            events_written: 2,
            stamped: 8,
            rows: 10,
            unstamped: 0,
            moved: changed.clone(),
            events: 2,
            events_without_before: 0,
        };
        (e, o)
    }

    #[test]
    fn a_right_import_passes() {
        let changed = keys(&["a", "b"]);
        let (e, o) = right(&changed);
        assert_eq!(problems(&e, &o), Vec::<String>::new());
    }

    /// Makes a right observation wrong in one way.
    type Breakage = fn(&mut Observed);

    #[test]
    fn every_wrong_result_is_caught() {
        let changed = keys(&["a", "b"]);
        let cases: [(&str, Breakage); 9] = [
            ("rows in the table", |o| o.rows = 11),
            ("not stamped", |o| o.unstamped = 1),
            ("upserted +", |o| o.stamped = 7),
            ("the feeds predict", |o| o.events = 3),
            ("written", |o| o.events_written = 1),
            ("without a before image", |o| o.events_without_before = 2),
            ("did not change", |o| {
                o.moved.insert((1, "c".into()));
            }),
            ("not on 1 that did", |o| {
                o.moved.remove(&(1, "a".to_string()));
            }),
            // The same id in another place is another row.
            ("not on 1 that did", |o| {
                o.moved.remove(&(1, "b".to_string()));
                o.moved.insert((2, "b".into()));
            }),
        ];
        for (want, break_it) in cases {
            let (e, mut o) = right(&changed);
            break_it(&mut o);
            let found = problems(&e, &o);
            assert!(found.iter().any(|p| p.contains(want)), "{want}: {found:?}");
        }
    }

    #[test]
    fn an_initial_import_has_no_before_images() {
        let changed = keys(&["a", "b", "c"]);
        let e = Expected { records: 3, changed: &changed, new_rows: 3, feed_changes: 3 };
        let o = Observed {
            upserted: 3,
            events_written: 3,
            stamped: 0,
            rows: 3,
            moved: changed.clone(),
            events: 3,
            events_without_before: 3,
            ..Default::default()
        };
        assert!(problems(&e, &o).is_empty());
        let o = Observed { events_without_before: 0, ..o };
        assert_eq!(problems(&e, &o).len(), 1);
    }
}
