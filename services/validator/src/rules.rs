//! Validation rules: one small struct per kind, built from configuration by
//! [`build`]. Pure: a rule looks at product versions and nothing else (not
//! the record's state, not the clock, not the network).
//!
//! Adding a rule kind = one struct implementing [`Rule`] + one arm in
//! [`build`] (+ the `RuleKind` variant in settings). The decision loop never
//! changes.

use std::fmt;

use shelfsync_proto::Product;
use shelfsync_settings::{RuleKind, RuleSettings};

/// A rule broken by a product version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Violation<'a> {
    /// The configured rule name.
    pub rule: &'a str,
    /// What a hidden record's state says.
    pub reason: &'a str,
}

/// A rule's name and the reason it writes into the state of what it hides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Label {
    pub name: String,
    pub reason: String,
}

impl Label {
    fn violation(&self) -> Violation<'_> {
        Violation { rule: &self.name, reason: &self.reason }
    }
}

/// One check of a product version.
pub trait Rule: Send + Sync + fmt::Debug {
    fn label(&self) -> &Label;

    /// Whether `after` (reached from `before`, when there is a trusted
    /// previous version) breaks the rule.
    fn check(&self, before: Option<&Product>, after: &Product) -> Option<Violation<'_>>;

    /// Whether this version gives the rule anything to judge. A rule that
    /// compares versions has nothing to say when what it compares did not
    /// move; a hide it made then stands (a stock update does not make a
    /// suspicious price trustworthy). Rules about one version always judge.
    fn judges(&self, _before: Option<&Product>, _after: &Product) -> bool {
        true
    }

    fn name(&self) -> &str {
        &self.label().name
    }

    fn reason(&self) -> &str {
        &self.label().reason
    }
}

/// The configured rules, in configuration order.
#[derive(Debug, Default)]
pub struct Rules(Vec<Box<dyn Rule>>);

impl Rules {
    pub fn from_settings(settings: &[RuleSettings]) -> Result<Rules, RuleError> {
        settings.iter().map(build).collect::<Result<Vec<_>, _>>().map(Rules)
    }

    pub fn iter(&self) -> impl Iterator<Item = &dyn Rule> {
        self.0.iter().map(|r| r.as_ref())
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A rule the configuration describes badly.
#[derive(Debug, thiserror::Error)]
#[error("validator rule `{rule}`: {problem}")]
pub struct RuleError {
    pub rule: String,
    pub problem: String,
}

/// The registry: a rule from its settings.
pub fn build(s: &RuleSettings) -> Result<Box<dyn Rule>, RuleError> {
    let err = |problem: &str| RuleError { rule: s.name.clone(), problem: problem.into() };
    if s.name.trim().is_empty() {
        return Err(err("a rule needs a name"));
    }
    let label = Label {
        name: s.name.clone(),
        reason: s.reason.clone().filter(|r| !r.trim().is_empty()).unwrap_or_else(|| s.name.clone()),
    };
    if s.kind != RuleKind::PriceJump && (s.max_drop_pct.is_some() || s.max_rise_pct.is_some()) {
        return Err(err("max_drop_pct and max_rise_pct only apply to price_jump rules"));
    }
    Ok(match s.kind {
        RuleKind::NonPositivePrice => Box::new(NonPositivePrice { label }),
        RuleKind::PriceJump => {
            if s.max_drop_pct.is_none() && s.max_rise_pct.is_none() {
                return Err(err("a price_jump rule needs max_drop_pct and/or max_rise_pct"));
            }
            Box::new(PriceJump {
                label,
                max_drop_pct: s.max_drop_pct,
                max_rise_pct: s.max_rise_pct,
            })
        }
        RuleKind::OldPriceBelowPrice => Box::new(OldPriceBelowPrice { label }),
        RuleKind::NegativeStock => Box::new(NegativeStock { label }),
        RuleKind::MissingTitle => Box::new(MissingText { label, field: |p| p.title.as_deref() }),
        RuleKind::MissingCategory => {
            Box::new(MissingText { label, field: |p| p.category.as_deref() })
        }
    })
}

/// A price that is present and zero or below. (A missing price is not
/// judged: a content feed may create a record before the price feed.)
#[derive(Debug)]
pub struct NonPositivePrice {
    label: Label,
}

impl Rule for NonPositivePrice {
    fn label(&self) -> &Label {
        &self.label
    }
    fn check(&self, _before: Option<&Product>, after: &Product) -> Option<Violation<'_>> {
        after.price.is_some_and(|p| p <= 0).then(|| self.label.violation())
    }
}

/// A price that moved too far at once from a positive previous price:
/// dropped by more than `max_drop_pct` or rose by more than `max_rise_pct`
/// percent of it. Exactly at a threshold is allowed.
#[derive(Debug)]
pub struct PriceJump {
    label: Label,
    max_drop_pct: Option<f64>,
    max_rise_pct: Option<f64>,
}

impl Rule for PriceJump {
    fn label(&self) -> &Label {
        &self.label
    }

    fn check(&self, before: Option<&Product>, after: &Product) -> Option<Violation<'_>> {
        let old = before?.price.filter(|&p| p > 0)?;
        let new = after.price?;
        // In i128: the difference of two i64 prices may not fit an i64.
        let change_pct = (i128::from(new) - i128::from(old)) as f64 * 100.0 / old as f64;
        let too_far = if change_pct < 0.0 {
            self.max_drop_pct.is_some_and(|max| -change_pct > max)
        } else {
            self.max_rise_pct.is_some_and(|max| change_pct > max)
        };
        too_far.then(|| self.label.violation())
    }

    fn judges(&self, before: Option<&Product>, after: &Product) -> bool {
        before.is_none_or(|b| b.price != after.price)
    }
}

/// An old (crossed-out) price below the price: a "discount" that is a rise.
#[derive(Debug)]
pub struct OldPriceBelowPrice {
    label: Label,
}

impl Rule for OldPriceBelowPrice {
    fn label(&self) -> &Label {
        &self.label
    }
    fn check(&self, _before: Option<&Product>, after: &Product) -> Option<Violation<'_>> {
        match (after.old_price, after.price) {
            (Some(old), Some(price)) if old < price => Some(self.label.violation()),
            _ => None,
        }
    }
}

#[derive(Debug)]
pub struct NegativeStock {
    label: Label,
}

impl Rule for NegativeStock {
    fn label(&self) -> &Label {
        &self.label
    }
    fn check(&self, _before: Option<&Product>, after: &Product) -> Option<Violation<'_>> {
        after.stock.is_some_and(|s| s < 0).then(|| self.label.violation())
    }
}

/// A text field that is missing or blank (title, category).
pub struct MissingText {
    label: Label,
    field: fn(&Product) -> Option<&str>,
}

impl fmt::Debug for MissingText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MissingText").field("label", &self.label).finish()
    }
}

impl Rule for MissingText {
    fn label(&self) -> &Label {
        &self.label
    }
    fn check(&self, _before: Option<&Product>, after: &Product) -> Option<Violation<'_>> {
        (self.field)(after).is_none_or(|t| t.trim().is_empty()).then(|| self.label.violation())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shelfsync_settings::ValidatorSettings;

    fn setting(kind: RuleKind) -> RuleSettings {
        RuleSettings {
            name: "r".into(),
            kind,
            reason: Some("because".into()),
            max_drop_pct: None,
            max_rise_pct: None,
        }
    }

    fn rule(kind: RuleKind) -> Box<dyn Rule> {
        build(&setting(kind)).expect("valid rule")
    }

    fn jump(drop: Option<f64>, rise: Option<f64>) -> Box<dyn Rule> {
        build(&RuleSettings {
            max_drop_pct: drop,
            max_rise_pct: rise,
            ..setting(RuleKind::PriceJump)
        })
        .expect("valid rule")
    }

    fn priced(price: Option<i64>) -> Product {
        Product { price, ..good() }
    }

    fn good() -> Product {
        Product {
            title: Some("Roses".into()),
            category: Some("flowers".into()),
            price: Some(1000),
            old_price: Some(1200),
            stock: Some(3),
            ..Default::default()
        }
    }

    fn hits(r: &dyn Rule, before: Option<&Product>, after: &Product) -> bool {
        r.check(before, after).is_some()
    }

    #[test]
    fn a_good_product_breaks_no_default_rule() {
        let rules = Rules::from_settings(&ValidatorSettings::default().rules).expect("defaults");
        assert_eq!(rules.len(), 6);
        let p = good();
        for r in rules.iter() {
            assert!(r.check(Some(&p), &p).is_none(), "{}", r.name());
            assert!(r.check(None, &p).is_none(), "{}", r.name());
        }
    }

    #[test]
    fn violations_carry_name_and_reason() {
        let r = rule(RuleKind::NonPositivePrice);
        assert_eq!(
            r.check(None, &priced(Some(0))),
            Some(Violation { rule: "r", reason: "because" })
        );
        // No reason configured: the name stands for it.
        let r = build(&RuleSettings { reason: None, ..setting(RuleKind::NegativeStock) })
            .expect("valid");
        assert_eq!(r.reason(), "r");
    }

    #[test]
    fn non_positive_price() {
        let r = rule(RuleKind::NonPositivePrice);
        assert!(hits(&*r, None, &priced(Some(0))), "price 0 is a value, and not positive");
        assert!(hits(&*r, None, &priced(Some(-5))));
        assert!(!hits(&*r, None, &priced(Some(1))));
        assert!(!hits(&*r, None, &priced(None)), "a missing price is not judged");
    }

    #[test]
    fn price_jump_drop_threshold_is_exclusive() {
        let r = jump(Some(90.0), None);
        let from = priced(Some(1000));
        assert!(!hits(&*r, Some(&from), &priced(Some(100))), "exactly 90% is allowed");
        assert!(hits(&*r, Some(&from), &priced(Some(99))), "90.1% is not");
        assert!(hits(&*r, Some(&from), &priced(Some(0))), "a drop to 0 is a 100% drop");
        assert!(!hits(&*r, Some(&from), &priced(Some(100_000))), "no rise limit configured");
    }

    #[test]
    fn price_jump_rise_threshold_is_exclusive() {
        let r = jump(None, Some(1000.0));
        let from = priced(Some(100));
        assert!(!hits(&*r, Some(&from), &priced(Some(1100))), "exactly +1000% is allowed");
        assert!(hits(&*r, Some(&from), &priced(Some(1101))));
        assert!(!hits(&*r, Some(&from), &priced(Some(1))), "no drop limit configured");
    }

    #[test]
    fn price_jump_needs_a_positive_baseline() {
        let r = jump(Some(50.0), Some(50.0));
        let to = priced(Some(1));
        assert!(!hits(&*r, None, &to), "a creation has nothing to compare with");
        assert!(!hits(&*r, Some(&priced(None)), &to));
        assert!(!hits(&*r, Some(&priced(Some(0))), &to), "no percentage of 0");
        assert!(!hits(&*r, Some(&priced(Some(10))), &priced(None)));
        // Extreme values do not overflow.
        assert!(hits(&*r, Some(&priced(Some(1))), &priced(Some(i64::MAX))));
        assert!(hits(&*r, Some(&priced(Some(i64::MAX))), &priced(Some(i64::MIN))));
    }

    #[test]
    fn price_jump_judges_only_a_moved_price() {
        let r = jump(Some(90.0), None);
        let p = priced(Some(10));
        assert!(!r.judges(Some(&p), &Product { stock: Some(9), ..p.clone() }));
        assert!(r.judges(Some(&p), &priced(Some(11))));
        assert!(r.judges(None, &p));
        // One-version rules always judge.
        assert!(rule(RuleKind::NonPositivePrice).judges(Some(&p), &p));
    }

    #[test]
    fn old_price_below_price() {
        let r = rule(RuleKind::OldPriceBelowPrice);
        let p = |old, price| Product { old_price: old, price, ..good() };
        assert!(hits(&*r, None, &p(Some(90), Some(100))));
        assert!(!hits(&*r, None, &p(Some(100), Some(100))), "equal is no discount, not a lie");
        assert!(!hits(&*r, None, &p(Some(110), Some(100))));
        assert!(!hits(&*r, None, &p(None, Some(100))));
        assert!(!hits(&*r, None, &p(Some(0), None)));
        assert!(hits(&*r, None, &p(Some(0), Some(1))));
    }

    #[test]
    fn negative_stock() {
        let r = rule(RuleKind::NegativeStock);
        let p = |stock| Product { stock, ..good() };
        assert!(hits(&*r, None, &p(Some(-1))));
        assert!(!hits(&*r, None, &p(Some(0))), "sold out is fine");
        assert!(!hits(&*r, None, &p(None)));
    }

    #[test]
    fn missing_title_and_category() {
        let title = rule(RuleKind::MissingTitle);
        let category = rule(RuleKind::MissingCategory);
        assert!(!hits(&*title, None, &good()));
        assert!(hits(&*title, None, &Product { title: None, ..good() }));
        assert!(hits(&*title, None, &Product { title: Some("  ".into()), ..good() }));
        assert!(!hits(&*category, None, &Product { title: None, ..good() }));
        assert!(hits(&*category, None, &Product { category: None, ..good() }));
        assert!(hits(&*category, None, &Product { category: Some(String::new()), ..good() }));
    }

    #[test]
    fn bad_rule_settings_are_refused() {
        let no_threshold = build(&setting(RuleKind::PriceJump)).expect_err("no threshold");
        assert!(no_threshold.to_string().contains("max_drop_pct"), "{no_threshold}");
        let misplaced =
            build(&RuleSettings { max_drop_pct: Some(5.0), ..setting(RuleKind::NegativeStock) })
                .expect_err("threshold on a non-jump rule");
        assert!(misplaced.to_string().contains("only apply to price_jump"), "{misplaced}");
        let unnamed = build(&RuleSettings { name: " ".into(), ..setting(RuleKind::MissingTitle) })
            .expect_err("no name");
        assert!(unnamed.to_string().contains("name"), "{unnamed}");
    }
}
