//! Ingest: turns partner feeds into per-record PATCH commands (docs/DESIGN.md,
//! Services).
//!
//! - [`feed`]: the streaming parser of the feed format (nested object or
//!   NDJSON), memory bounded independently of the feed size; pure;
//! - [`item`]: validation of one item with stable reasons, and its mapping
//!   to a PATCH of only the fields the partner owns; pure;
//! - `import`: one import end to end ([`Importer`]): parser thread → bounded
//!   channel → batched, deduplicated publishing → sweeps after a good full
//!   import → [`ImportReport`];
//! - `source`: files, HTTP(S) with ETag / If-Modified-Since, pushed streams;
//! - `state`: ingest's own Redis keys (HTTP validators, last reports, the
//!   places full imports carried, leases and generations);
//! - `lease`: one full import per partner at a time, across processes: a
//!   lease in Redis, renewed while the import runs, checked before it sweeps;
//! - `report`: the report, the progress counts and [`ImportError`];
//! - `auth`: who may push a partner's feed (bearer tokens from a file or an
//!   environment variable, re-read on rotation) and the refusals;
//! - `app`: the service ([`App`]): poll loops and the push / probe endpoints.
//!
//! It publishes commands, sweeps and rejections; it never reads or writes
//! records (storage owns them) and decides no business rule (validators do).
#![forbid(unsafe_code)]

mod app;
mod auth;
pub mod feed;
mod import;
pub mod item;
mod lease;
mod metrics;
mod report;
mod source;
mod state;

pub use app::App;
pub use import::{Clock, ImportConfig, Importer, ProgressFn};
pub use report::{HeldSweep, ImportError, ImportReport, ImportStatus, Progress};
pub use source::{Source, Validators};
