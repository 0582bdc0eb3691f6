//! Top-N queries, whatever they arrive by: validation of the raw input
//! (HTTP parameters or a `TopRequest`) into a [`TopQuery`], and [`Api`], the
//! read side both transports call. Owns the limits and the readiness check;
//! never writes to the index.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use shelfsync_feed::FeedStatus;
use shelfsync_proto::{Recommendation, TopReply, TopRequest};
use shelfsync_settings::RecommenderSettings;

use crate::feed::SharedIndex;
use crate::index::{PlaceKey, Query, TopItem};
use crate::metrics::{self, Transport};

/// Longest product id or category accepted (as storage's read API).
pub const MAX_ID_BYTES: usize = 512;
/// Most product ids one query may exclude.
pub const MAX_EXCLUDE: usize = 1000;

/// Why a query was not answered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueryError {
    #[error("{0}")]
    BadRequest(String),
    #[error("not ready: the index is still bootstrapping")]
    NotReady,
}

fn bad(msg: impl Into<String>) -> QueryError {
    QueryError::BadRequest(msg.into())
}

/// How many results a query may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub default_top_n: usize,
    pub max_top_n: usize,
}

impl From<&RecommenderSettings> for Limits {
    fn from(s: &RecommenderSettings) -> Self {
        Self { default_top_n: s.default_top_n, max_top_n: s.max_top_n }
    }
}

/// A validated top-N query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopQuery {
    pub place: PlaceKey,
    pub category: Option<String>,
    pub limit: usize,
    pub exclude: Vec<String>,
}

impl TopQuery {
    /// From the NATS request; `limit = 0` (unset in proto3) is the default.
    pub fn from_request(req: TopRequest, limits: Limits) -> Result<TopQuery, QueryError> {
        let limit = usize::try_from(req.limit).unwrap_or(usize::MAX);
        Self::checked(req.brand_id, req.place_id, req.category, Some(limit), req.exclude, limits)
    }

    /// From `GET /v1/top/{brand}/{place}?category=..&limit=..&exclude=a,b`
    /// (`exclude` may also repeat).
    pub fn from_http(
        brand: &str,
        place: &str,
        params: &[(String, String)],
        limits: Limits,
    ) -> Result<TopQuery, QueryError> {
        let int = |what: &str, v: &str| {
            v.parse::<i64>().map_err(|_| bad(format!("{what} must be an integer, got {v:?}")))
        };
        let (brand_id, place_id) = (int("brand", brand)?, int("place", place)?);
        let (mut category, mut limit, mut exclude) = (None, None, Vec::new());
        for (k, v) in params {
            match k.as_str() {
                "category" if category.is_none() => category = Some(v.clone()),
                "limit" if limit.is_none() => {
                    let n: usize = v.parse().map_err(|_| {
                        bad(format!(
                            "limit must be an integer between 1 and {}, got {v:?}",
                            limits.max_top_n
                        ))
                    })?;
                    if n == 0 {
                        return Err(bad(format!(
                            "limit must be between 1 and {}, got 0",
                            limits.max_top_n
                        )));
                    }
                    limit = Some(n);
                }
                // An empty value is no exclusion (`exclude=` from an empty list).
                "exclude" if v.is_empty() => {}
                "exclude" => exclude.extend(v.split(',').map(String::from)),
                "category" | "limit" => return Err(bad(format!("{k} given more than once"))),
                _ => {
                    return Err(bad(format!(
                        "unknown parameter {k:?} (known: category, limit, exclude)"
                    )));
                }
            }
        }
        Self::checked(brand_id, place_id, category, limit, exclude, limits)
    }

    fn checked(
        brand_id: i64,
        place_id: i64,
        category: Option<String>,
        limit: Option<usize>,
        exclude: Vec<String>,
        limits: Limits,
    ) -> Result<TopQuery, QueryError> {
        let limit = match limit {
            None | Some(0) => limits.default_top_n,
            Some(n) if n > limits.max_top_n => {
                return Err(bad(format!("limit {n} is over the maximum of {}", limits.max_top_n)));
            }
            Some(n) => n,
        };
        // An empty category is no filter: offers without a category are
        // found by queries without one.
        let category = category.filter(|c| !c.is_empty());
        if let Some(c) = &category
            && c.len() > MAX_ID_BYTES
        {
            return Err(bad(format!(
                "category must be at most {MAX_ID_BYTES} bytes, got {}",
                c.len()
            )));
        }
        if exclude.len() > MAX_EXCLUDE {
            return Err(bad(format!("at most {MAX_EXCLUDE} excluded ids, got {}", exclude.len())));
        }
        if let Some(id) = exclude.iter().find(|id| id.is_empty() || id.len() > MAX_ID_BYTES) {
            return Err(bad(format!(
                "excluded product ids must be 1 to {MAX_ID_BYTES} bytes, got {} bytes",
                id.len()
            )));
        }
        Ok(TopQuery { place: PlaceKey::new(brand_id, place_id), category, limit, exclude })
    }
}

impl From<TopItem> for Recommendation {
    fn from(i: TopItem) -> Self {
        Recommendation {
            product_id: i.product_id,
            category: i.category,
            price: i.price,
            old_price: i.old_price,
            stock: i.stock,
            discount: i.discount,
        }
    }
}

/// The read side: answers validated queries from the shared index once the
/// feed has bootstrapped. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Api {
    index: SharedIndex,
    feed: Arc<FeedStatus>,
    stopping: Arc<AtomicBool>,
    pub limits: Limits,
}

impl Api {
    pub fn new(index: SharedIndex, feed: Arc<FeedStatus>, limits: Limits) -> Self {
        Self { index, feed, stopping: Arc::default(), limits }
    }

    /// Bootstrapped from keyframes and not shutting down.
    pub fn ready(&self) -> bool {
        self.feed.bootstrapped.load(Ordering::SeqCst) && !self.stopping.load(Ordering::SeqCst)
    }

    /// From now on, `ready` is false (a graceful stop has begun).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    pub fn index(&self) -> &SharedIndex {
        &self.index
    }

    pub fn feed(&self) -> &FeedStatus {
        &self.feed
    }

    /// Answers a query. Before bootstrap the index is partial, so it says so
    /// rather than answer wrong.
    pub fn top(&self, q: &TopQuery) -> Result<Vec<TopItem>, QueryError> {
        if !self.feed.bootstrapped.load(Ordering::SeqCst) {
            return Err(QueryError::NotReady);
        }
        let query = Query { category: q.category.as_deref(), limit: q.limit, exclude: &q.exclude };
        Ok(self.index.read().top(q.place, query))
    }

    /// The NATS request/reply form: errors travel in `TopReply.error`.
    pub fn answer(&self, req: TopRequest) -> TopReply {
        metrics::query(Transport::Nats);
        match TopQuery::from_request(req, self.limits).and_then(|q| self.top(&q)) {
            Ok(items) => TopReply {
                items: items.into_iter().map(Into::into).collect(),
                error: String::new(),
            },
            Err(e) => {
                metrics::rejected();
                TopReply { items: Vec::new(), error: e.to_string() }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits { default_top_n: 10, max_top_n: 100 };

    fn params(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn http(brand: &str, place: &str, pairs: &[(&str, &str)]) -> Result<TopQuery, QueryError> {
        TopQuery::from_http(brand, place, &params(pairs), LIMITS)
    }

    fn err(r: Result<TopQuery, QueryError>) -> String {
        r.expect_err("should be refused").to_string()
    }

    #[test]
    fn http_parameters() {
        let q = http("7", "1", &[]).expect("ok");
        assert_eq!(
            q,
            TopQuery { place: PlaceKey::new(7, 1), category: None, limit: 10, exclude: vec![] }
        );
        let q = http(
            "7",
            "1",
            &[("category", "roses"), ("limit", "100"), ("exclude", "a,b"), ("exclude", "c")],
        )
        .expect("ok");
        assert_eq!(q.category.as_deref(), Some("roses"));
        assert_eq!(q.limit, 100);
        assert_eq!(q.exclude, ["a", "b", "c"]);
        // Empty values are "not given".
        let q = http("7", "1", &[("category", ""), ("exclude", "")]).expect("ok");
        assert_eq!((q.category, q.exclude.len()), (None, 0));
    }

    #[test]
    fn http_bad_input_is_explained() {
        assert!(err(http("x", "1", &[])).contains("brand must be an integer"));
        assert!(err(http("7", "1.5", &[])).contains("place must be an integer"));
        assert!(err(http("7", "1", &[("limit", "101")])).contains("over the maximum of 100"));
        assert!(err(http("7", "1", &[("limit", "0")])).contains("between 1 and 100"));
        assert!(err(http("7", "1", &[("limit", "ten")])).contains("limit must be an integer"));
        assert!(err(http("7", "1", &[("limit", "1"), ("limit", "2")])).contains("more than once"));
        assert!(err(http("7", "1", &[("categroy", "x")])).contains("unknown parameter"));
        assert!(err(http("7", "1", &[("exclude", "a,,b")])).contains("1 to 512 bytes"));
        let long = "x".repeat(513);
        assert!(err(http("7", "1", &[("exclude", &long)])).contains("got 513 bytes"));
        assert!(err(http("7", "1", &[("category", &long)])).contains("category must be"));
        let many = vec!["a"; 1001].join(",");
        assert!(err(http("7", "1", &[("exclude", &many)])).contains("at most 1000"));
    }

    #[test]
    fn nats_requests() {
        let req = |limit, exclude: Vec<String>| TopRequest {
            brand_id: 7,
            place_id: 1,
            category: Some("roses".into()),
            limit,
            exclude,
        };
        let q = TopQuery::from_request(req(0, vec!["a".into()]), LIMITS).expect("ok");
        assert_eq!((q.limit, q.exclude.len()), (10, 1));
        assert_eq!(TopQuery::from_request(req(100, vec![]), LIMITS).expect("ok").limit, 100);
        let mut any = req(1, vec![]);
        any.category = Some(String::new());
        assert_eq!(TopQuery::from_request(any, LIMITS).expect("ok").category, None);
        assert!(err(TopQuery::from_request(req(101, vec![]), LIMITS)).contains("over the maximum"));
        assert!(err(TopQuery::from_request(req(1, vec![String::new()]), LIMITS)).contains("bytes"));
    }

    #[test]
    fn not_ready_until_bootstrapped() {
        let feed = Arc::new(FeedStatus::default());
        let api = Api::new(SharedIndex::default(), feed.clone(), LIMITS);
        let req = TopRequest { brand_id: 7, place_id: 1, ..Default::default() };
        assert!(!api.ready());
        assert_eq!(api.answer(req.clone()).error, QueryError::NotReady.to_string());
        feed.bootstrapped.store(true, Ordering::SeqCst);
        assert!(api.ready());
        assert_eq!(api.answer(req), TopReply::default());
        api.stop();
        assert!(!api.ready());
    }
}
