//! The decision (pure): what one record update asks of the validator, and
//! the CAS command that carries it out. No I/O, no clock (the caller passes
//! the time).
//!
//! - violations and not hidden → **hide**; hidden by the validator for other
//!   reasons → hide again with the current reasons;
//! - no violations and hidden *by the validator* → **un-hide** (a record
//!   hidden by someone else is theirs to show);
//! - otherwise, and for deleted or absent records, → nothing.
//!
//! Only versions whose **data** changed are judged (or that just became
//! live). A state-only change — the validator's own PATCH, an operator's
//! decision — is never judged again, so the validator cannot loop on its own
//! writes and does not fight an operator.
//!
//! Every command carries `expected_updated_at` = the version judged: if the
//! record moved on meanwhile, storage rejects it (`conflict`) and the newer
//! version comes through the change stream to be judged in turn.

use prost::Message;
use shelfsync_feed::{Update, is_live, product_of, state_of};
use shelfsync_proto::{Command, CommandKind, Origin, RecordKey, RecordState, state_field};

use crate::rules::Rules;

/// `decided_by` of the states the validator writes, and the `Origin` source
/// of its commands.
pub const DECIDED_BY: &str = "validator";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Hide, saying why (the reasons of the broken rules, in rule order).
    Hide {
        reasons: Vec<String>,
    },
    Unhide,
    Nothing,
}

fn hidden_by_us(s: &RecordState) -> bool {
    s.hidden == Some(true) && s.decided_by.as_deref() == Some(DECIDED_BY)
}

/// Judges one update against the rules.
pub fn decide(rules: &Rules, u: &Update) -> Decision {
    if !is_live(&u.after) {
        return Decision::Nothing;
    }
    if u.before.as_ref().is_some_and(|b| is_live(b) && b.data == u.after.data) {
        return Decision::Nothing;
    }
    let after = product_of(&u.after);
    let state = state_of(&u.after);
    let ours = hidden_by_us(&state);
    let before = u.before.as_ref().map(|b| (product_of(b), state_of(b)));
    let before_product = before.as_ref().map(|(p, _)| p);

    let mut reasons: Vec<String> = Vec::new();
    for rule in rules.iter() {
        let reason = rule.reason();
        // A value a rule flagged is no baseline for it: after a hidden price
        // drop, the corrected price is judged on its own, not as a rise.
        let flagged_before = before
            .as_ref()
            .is_some_and(|(_, s)| hidden_by_us(s) && s.reasons.iter().any(|r| r == reason));
        let baseline = before_product.filter(|_| !flagged_before);
        let broken = rule.check(baseline, &after).is_some()
            // Nothing new to judge: a hide this rule made stands.
            || (ours
                && !rule.judges(before_product, &after)
                && state.reasons.iter().any(|r| r == reason));
        if broken && !reasons.iter().any(|r| r == reason) {
            reasons.push(reason.to_string());
        }
    }

    let hidden = state.hidden == Some(true);
    match (reasons.is_empty(), hidden) {
        (false, false) => Decision::Hide { reasons },
        (false, true) if ours && reasons != state.reasons => Decision::Hide { reasons },
        (true, true) if ours => Decision::Unhide,
        _ => Decision::Nothing,
    }
}

impl Decision {
    /// The state PATCH that carries the decision out, conditional on the
    /// record still being the version `u` shows. `None` for [`Decision::Nothing`].
    pub fn command(&self, u: &Update, now_us: i64) -> Option<Command> {
        let (state, clear) = match self {
            Decision::Nothing => return None,
            Decision::Hide { reasons } => (
                RecordState {
                    hidden: Some(true),
                    reasons: reasons.clone(),
                    decided_by: Some(DECIDED_BY.into()),
                    decided_at: Some(now_us),
                },
                Vec::new(),
            ),
            // An empty repeated field is not on the wire: clear it instead.
            Decision::Unhide => (
                RecordState {
                    hidden: Some(false),
                    reasons: Vec::new(),
                    decided_by: Some(DECIDED_BY.into()),
                    decided_at: Some(now_us),
                },
                vec![state_field::REASONS],
            ),
        };
        Some(Command {
            key: Some(u.key.clone()),
            kind: CommandKind::Patch as i32,
            state: state.encode_to_vec(),
            clear_state_fields: clear,
            expected_updated_at: Some(u.after.updated_at),
            origin: Some(Origin {
                source: DECIDED_BY.into(),
                import_id: String::new(),
                published_at: now_us,
            }),
            ..Default::default()
        })
    }
}

/// The deterministic id of one decision command:
/// `val:{brand}:{place}:{product}:{updated_at}:{hide|unhide}`. A redelivered
/// change yields the same id, which JetStream's duplicate window drops. A
/// product id that is not plain printable ASCII (unsafe in a header) is
/// replaced by its hash.
pub fn decision_id(cmd: &Command) -> String {
    let key = cmd.key.clone().unwrap_or_default();
    let verb = if RecordState::decode(cmd.state.as_slice()).is_ok_and(|s| s.hidden == Some(true)) {
        "hide"
    } else {
        "unhide"
    };
    format!(
        "val:{}:{}:{}:{}:{verb}",
        key.brand_id,
        key.place_id,
        header_safe(&key),
        cmd.expected_updated_at.unwrap_or(0)
    )
}

fn header_safe(key: &RecordKey) -> String {
    let id = &key.product_id;
    if id.bytes().all(|b| b.is_ascii_graphic()) {
        id.clone()
    } else {
        format!("#{:016x}", xxhash_rust::xxh3::xxh3_64(id.as_bytes()))
    }
}

/// The id of a message carrying these commands: the decision id for one,
/// the first one's id, the count and a hash of all ids for several (so a
/// different set never shares an id with this one).
pub fn batch_id(commands: &[Command]) -> String {
    let ids: Vec<String> = commands.iter().map(decision_id).collect();
    match ids.as_slice() {
        [one] => one.clone(),
        [first, ..] => format!(
            "{first}:+{}:{:016x}",
            ids.len() - 1,
            xxhash_rust::xxh3::xxh3_64(ids.join("\n").as_bytes())
        ),
        [] => "val:empty".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shelfsync_feed::UpdateKind;
    use shelfsync_proto::{Product, Record};
    use shelfsync_settings::{RuleKind, RuleSettings, ValidatorSettings};

    const T0: i64 = 1_700_000_000_000_000;

    fn rules() -> Rules {
        Rules::from_settings(&ValidatorSettings::default().rules).expect("default rules")
    }

    fn good() -> Product {
        Product {
            title: Some("Roses".into()),
            category: Some("flowers".into()),
            price: Some(1000),
            stock: Some(3),
            ..Default::default()
        }
    }

    fn priced(price: i64) -> Product {
        Product { price: Some(price), ..good() }
    }

    fn record(p: &Product, state: &RecordState, updated_at: i64) -> Record {
        Record {
            key: Some(RecordKey::new(7, 1, "sku")),
            data: p.encode_to_vec(),
            state: state.encode_to_vec(),
            updated_at,
            ..Default::default()
        }
    }

    fn visible() -> RecordState {
        RecordState::default()
    }

    fn hidden_by(who: &str, reasons: &[&str]) -> RecordState {
        RecordState {
            hidden: Some(true),
            reasons: reasons.iter().map(|r| r.to_string()).collect(),
            decided_by: Some(who.into()),
            decided_at: Some(T0),
        }
    }

    fn update(before: Option<Record>, after: Record) -> Update {
        let kind = if before.is_some() { UpdateKind::Updated } else { UpdateKind::Created };
        Update { key: RecordKey::new(7, 1, "sku"), before, after, kind, origin: None }
    }

    /// A data change from `(p0, s)` to `(p1, s)`: the state stays as it was.
    fn data_change(p0: &Product, p1: &Product, s: &RecordState) -> Update {
        update(Some(record(p0, s, T0)), record(p1, s, T0 + 1))
    }

    fn hide(reasons: &[&str]) -> Decision {
        Decision::Hide { reasons: reasons.iter().map(|r| r.to_string()).collect() }
    }

    const PRICE: &str = "price is not positive";
    const JUMP: &str = "price moved too far at once";
    const TITLE: &str = "title is missing";

    #[test]
    fn a_bad_creation_is_hidden_with_every_reason() {
        let p = Product { title: None, price: Some(0), ..good() };
        let d = decide(&rules(), &update(None, record(&p, &visible(), T0)));
        assert_eq!(d, hide(&[PRICE, TITLE]));
        assert_eq!(
            decide(&rules(), &update(None, record(&good(), &visible(), T0))),
            Decision::Nothing
        );
    }

    #[test]
    fn a_fix_unhides_what_the_validator_hid() {
        let s = hidden_by(DECIDED_BY, &[PRICE]);
        assert_eq!(decide(&rules(), &data_change(&priced(0), &priced(500), &s)), Decision::Unhide);
    }

    #[test]
    fn only_own_hides_are_undone() {
        let s = hidden_by("ops", &["manual"]);
        assert_eq!(decide(&rules(), &data_change(&priced(0), &priced(500), &s)), Decision::Nothing);
        // ... and a record someone else hid is not re-hidden by the validator either.
        assert_eq!(decide(&rules(), &data_change(&priced(500), &priced(0), &s)), Decision::Nothing);
    }

    #[test]
    fn nothing_on_its_own_state_patch() {
        // The change the validator's hide produced: same data, new state.
        let bad = priced(0);
        let hide_change = update(
            Some(record(&bad, &visible(), T0)),
            record(&bad, &hidden_by(DECIDED_BY, &[PRICE]), T0 + 1),
        );
        assert_eq!(decide(&rules(), &hide_change), Decision::Nothing);
        // ... and the one its un-hide produced.
        let unhidden =
            RecordState { hidden: Some(false), decided_by: Some(DECIDED_BY.into()), ..visible() };
        let unhide_change = update(
            Some(record(&good(), &hidden_by(DECIDED_BY, &[PRICE]), T0)),
            record(&good(), &unhidden, T0 + 1),
        );
        assert_eq!(decide(&rules(), &unhide_change), Decision::Nothing);
        // Even when the data was bad all along, an operator's un-hide stands.
        let operator =
            RecordState { hidden: Some(false), decided_by: Some("ops".into()), ..visible() };
        let shown = update(
            Some(record(&bad, &hidden_by(DECIDED_BY, &[PRICE]), T0)),
            record(&bad, &operator, T0 + 1),
        );
        assert_eq!(decide(&rules(), &shown), Decision::Nothing);
    }

    #[test]
    fn deleted_and_absent_records_are_skipped() {
        let mut deleted = record(&priced(0), &visible(), T0 + 1);
        deleted.deleted = true;
        assert_eq!(
            decide(&rules(), &update(Some(record(&priced(0), &visible(), T0)), deleted)),
            Decision::Nothing
        );
        let mut absent = record(&priced(0), &visible(), T0 + 1);
        absent.absent = true;
        assert_eq!(
            decide(&rules(), &update(Some(record(&good(), &visible(), T0)), absent)),
            Decision::Nothing
        );
        // Back from absent with bad data it had all along: judged again.
        let mut gone = record(&priced(0), &visible(), T0);
        gone.absent = true;
        let back = update(Some(gone), record(&priced(0), &visible(), T0 + 1));
        assert_eq!(decide(&rules(), &back), hide(&[PRICE]));
    }

    #[test]
    fn hidden_with_other_reasons_is_hidden_again_with_the_current_ones() {
        let s = hidden_by(DECIDED_BY, &[TITLE]);
        let was = Product { title: None, ..good() };
        let now = Product { price: Some(0), ..good() };
        // (1000 → 0 is also a jump: the previous price was not what was flagged.)
        assert_eq!(decide(&rules(), &data_change(&was, &now, &s)), hide(&[PRICE, JUMP]));
        // Same reasons: nothing to write.
        let also = Product { title: None, stock: Some(1), ..good() };
        assert_eq!(decide(&rules(), &data_change(&was, &also, &s)), Decision::Nothing);
    }

    #[test]
    fn a_jump_hide_stands_until_the_price_moves() {
        let s = visible();
        // 1000 → 50: a 95% drop.
        assert_eq!(decide(&rules(), &data_change(&priced(1000), &priced(50), &s)), hide(&[JUMP]));
        let hidden = hidden_by(DECIDED_BY, &[JUMP]);
        // A stock update of the hidden record: the price did not move.
        let restocked = Product { stock: Some(10), ..priced(50) };
        assert_eq!(
            decide(&rules(), &data_change(&priced(50), &restocked, &hidden)),
            Decision::Nothing
        );
        // The partner corrects it: 50 → 1000 is judged on its own, not as a
        // +1900% rise from a price the rule flagged.
        assert_eq!(
            decide(&rules(), &data_change(&priced(50), &priced(1000), &hidden)),
            Decision::Unhide
        );
    }

    #[test]
    fn a_moderate_move_after_a_visible_price_is_fine() {
        // The CAS race of the integration test: 100 was never hidden, so
        // 100 → 200 (+100%) is a normal move.
        assert_eq!(
            decide(&rules(), &data_change(&priced(100), &priced(200), &visible())),
            Decision::Nothing
        );
    }

    #[test]
    fn rules_sharing_a_reason_report_it_once() {
        let mk = |name: &str, kind| RuleSettings {
            name: name.into(),
            kind,
            reason: Some("bad offer".into()),
            max_drop_pct: None,
            max_rise_pct: None,
        };
        let rules = Rules::from_settings(&[
            mk("a", RuleKind::NonPositivePrice),
            mk("b", RuleKind::NegativeStock),
        ])
        .expect("rules");
        let p = Product { price: Some(0), stock: Some(-1), ..good() };
        assert_eq!(decide(&rules, &update(None, record(&p, &visible(), T0))), hide(&["bad offer"]));
    }

    #[test]
    fn commands_are_cas_state_patches() {
        let u = update(None, record(&priced(0), &visible(), T0));
        let cmd = hide(&[PRICE]).command(&u, T0 + 5).expect("a command");
        assert_eq!(cmd.kind, CommandKind::Patch as i32);
        assert_eq!(cmd.expected_updated_at, Some(T0));
        assert!(cmd.data.is_empty(), "the validator never touches data");
        let state = RecordState::decode(cmd.state.as_slice()).expect("state");
        assert_eq!(
            state,
            RecordState { decided_at: Some(T0 + 5), ..hidden_by(DECIDED_BY, &[PRICE]) }
        );
        assert_eq!(cmd.origin.as_ref().map(|o| o.source.as_str()), Some(DECIDED_BY));
        assert_eq!(decision_id(&cmd), format!("val:7:1:sku:{T0}:hide"));

        let cmd = Decision::Unhide.command(&u, T0 + 5).expect("a command");
        let state = RecordState::decode(cmd.state.as_slice()).expect("state");
        assert_eq!(state.hidden, Some(false));
        assert_eq!(state.decided_by.as_deref(), Some(DECIDED_BY));
        assert_eq!(cmd.clear_state_fields, vec![state_field::REASONS]);
        assert_eq!(decision_id(&cmd), format!("val:7:1:sku:{T0}:unhide"));

        assert!(Decision::Nothing.command(&u, T0).is_none());
    }

    #[test]
    fn message_ids_are_deterministic_and_header_safe() {
        let mut u = update(None, record(&priced(0), &visible(), T0));
        let a = hide(&[PRICE]).command(&u, T0 + 1).expect("cmd");
        let a_later = hide(&[PRICE]).command(&u, T0 + 99).expect("cmd");
        assert_eq!(batch_id(std::slice::from_ref(&a)), batch_id(std::slice::from_ref(&a_later)));
        u.key.product_id = "роза\n1".into();
        let odd = hide(&[PRICE]).command(&u, T0).expect("cmd");
        let id = decision_id(&odd);
        assert!(id.bytes().all(|b| b.is_ascii_graphic()), "{id}");
        let two = batch_id(&[a.clone(), odd.clone()]);
        assert!(two.starts_with(&decision_id(&a)), "{two}");
        assert_ne!(two, batch_id(&[odd, a]), "another set, another id");
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        fn text() -> impl Strategy<Value = Option<String>> {
            prop_oneof![Just(None), Just(Some(String::new())), Just(Some("x".to_string()))]
        }

        fn product() -> impl Strategy<Value = Product> {
            let price = proptest::option::of(prop_oneof![Just(0i64), -5i64..5, 1i64..100_000]);
            let old = proptest::option::of(0i64..100_000);
            let stock = proptest::option::of(-2i64..5);
            (price, old, stock, text(), text()).prop_map(
                |(price, old_price, stock, title, category)| Product {
                    price,
                    old_price,
                    stock,
                    title,
                    category,
                    ..Default::default()
                },
            )
        }

        fn state() -> impl Strategy<Value = RecordState> {
            let who = prop_oneof![Just(None), Just(Some(DECIDED_BY)), Just(Some("ops"))];
            let reasons =
                proptest::sample::subsequence(vec![PRICE, JUMP, TITLE, "retired rule"], 0..3);
            (proptest::option::of(any::<bool>()), who, reasons).prop_map(
                |(hidden, who, reasons)| RecordState {
                    hidden,
                    reasons: reasons.into_iter().map(String::from).collect(),
                    decided_by: who.map(String::from),
                    decided_at: who.map(|_| T0),
                },
            )
        }

        /// Applies a command's state PATCH as storage does (wire merge).
        fn patched(r: &Record, cmd: &Command, at: i64) -> Record {
            let state = shelfsync_merge::merge(&r.state, &cmd.state, &cmd.clear_state_fields)
                .expect("mergeable state");
            Record { state, updated_at: at, ..r.clone() }
        }

        proptest! {
            /// The validator's own write never asks for another write: neither
            /// the change it produces, nor the judged version replayed with
            /// the state it wrote (a redelivery) calls for a command.
            #[test]
            fn decisions_reach_a_fixed_point(
                before in proptest::option::of((product(), state())),
                after in product(),
                after_state in state(),
            ) {
                let rules = rules();
                let before = before.map(|(p, s)| {
                    let mut r = record(&p, &s, T0);
                    r.state = shelfsync_merge::canonicalize(&r.state).expect("canonical");
                    r
                });
                let mut judged = record(&after, &after_state, T0 + 1);
                judged.state = shelfsync_merge::canonicalize(&judged.state).expect("canonical");
                let u = update(before.clone(), judged.clone());
                let Some(cmd) = decide(&rules, &u).command(&u, T0 + 2) else {
                    return Ok(());
                };
                prop_assert_eq!(cmd.expected_updated_at, Some(T0 + 1));
                let written = patched(&judged, &cmd, T0 + 3);
                prop_assert_ne!(&written.state, &judged.state, "a command must change the state");
                let own_change = update(Some(judged.clone()), written.clone());
                prop_assert_eq!(decide(&rules, &own_change), Decision::Nothing);
                let replay = update(before, Record { updated_at: T0 + 1, ..written });
                prop_assert_eq!(decide(&rules, &replay), Decision::Nothing);
            }
        }
    }
}
