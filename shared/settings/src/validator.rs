//! `[validator]`: the validator's consumer, listener and rules.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::{SettingsError, invalid};

/// One validation rule: `kind` picks the check, `reason` is what a hidden
/// record's state says.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RuleSettings {
    pub name: String,
    pub kind: RuleKind,
    #[serde(default)]
    pub reason: Option<String>,
    /// For `price_jump`: the largest allowed drop, in percent of the old price.
    #[serde(default)]
    pub max_drop_pct: Option<f64>,
    /// For `price_jump`: the largest allowed rise, in percent of the old price.
    #[serde(default)]
    pub max_rise_pct: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RuleKind {
    NonPositivePrice,
    PriceJump,
    OldPriceBelowPrice,
    NegativeStock,
    MissingTitle,
    MissingCategory,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ValidatorSettings {
    /// Durable consumer shared by every validator replica.
    pub consumer: String,
    pub http_listen: String,
    pub rules: Vec<RuleSettings>,
}

impl Default for ValidatorSettings {
    fn default() -> Self {
        let rule = |name: &str, kind, reason: &str| RuleSettings {
            name: name.into(),
            kind,
            reason: Some(reason.into()),
            max_drop_pct: None,
            max_rise_pct: None,
        };
        Self {
            consumer: "validator".into(),
            http_listen: "127.0.0.1:8082".into(),
            rules: vec![
                rule("non_positive_price", RuleKind::NonPositivePrice, "price is not positive"),
                RuleSettings {
                    max_drop_pct: Some(90.0),
                    max_rise_pct: Some(1000.0),
                    ..rule("price_jump", RuleKind::PriceJump, "price moved too far at once")
                },
                rule(
                    "old_price_below_price",
                    RuleKind::OldPriceBelowPrice,
                    "old price is below the price",
                ),
                rule("negative_stock", RuleKind::NegativeStock, "stock is negative"),
                rule("missing_title", RuleKind::MissingTitle, "title is missing"),
                rule("missing_category", RuleKind::MissingCategory, "category is missing"),
            ],
        }
    }
}

impl ValidatorSettings {
    /// Checks what types alone cannot.
    pub fn validate(&self) -> Result<(), SettingsError> {
        let mut rule_names = HashSet::new();
        for (i, r) in self.rules.iter().enumerate() {
            if !rule_names.insert(r.name.as_str()) {
                return Err(invalid(
                    format!("validator.rules[{i}].name"),
                    format!("rule `{}` is defined twice", r.name),
                ));
            }
            for (k, v) in [("max_drop_pct", r.max_drop_pct), ("max_rise_pct", r.max_rise_pct)] {
                if v.is_some_and(|v| !(v > 0.0 && v.is_finite())) {
                    return Err(invalid(
                        format!("validator.rules[{i}].{k}"),
                        "must be a positive number",
                    ));
                }
            }
        }
        Ok(())
    }
}
