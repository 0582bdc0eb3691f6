//! shelfsync recommender: an in-memory index of the offers that can be
//! recommended — visible, present, not deleted, in stock, priced — per place
//! and category, ranked by discount depth, then stock, then product id;
//! answered as top-N queries in microseconds.
//!
//! - `GET /v1/top/{brand}/{place}?category=C&limit=N&exclude=a,b` → JSON list
//!   of `{product_id, category, price, old_price, stock, discount}`, best
//!   first. No (or an empty) `category`: every category of the place,
//!   offers without a category included. `limit` defaults to
//!   `recommender.default_top_n`; over `recommender.max_top_n` is a 400, as
//!   are malformed ids; 503 until bootstrapped.
//! - NATS request/reply on `<prefix>.recommend.top` (queue group
//!   `recommender`): `TopRequest` → `TopReply` (`error` set instead of a 400).
//! - `/healthz`, `/readyz` (503 until the index is bootstrapped from the
//!   keyframes and the change stream is tailed), `/metrics`.
//!
//! State is memory only: every instance rebuilds it at start from keyframes
//! plus changes, through the ChangeFeed kit. Modules:
//!
//! - `index` — the pure ranking structure (where most tests live);
//! - `feed` — the ChangeFeed handler: which record versions are offers;
//! - `query` — validation and the read API both transports share;
//! - `http`, `nats` — the transports;
//! - `metrics` — every metric it exports, recorded by typed functions;
//! - `app` — wiring, run until stopped.
#![forbid(unsafe_code)]

mod app;
mod feed;
mod http;
pub mod index;
pub mod metrics;
mod nats;
mod query;

pub use app::App;
pub use feed::{IndexHandler, Op, SharedIndex};
pub use index::{Index, Offer, PlaceKey, Query, TopItem, discount, discount_bp};
pub use query::{Api, Limits, MAX_EXCLUDE, MAX_ID_BYTES, QueryError, TopQuery};
