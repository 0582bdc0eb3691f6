//! Read API for current state (the "fetch" of a feature store): one record,
//! a batch of records of one place, or a whole place page by page, answered
//! from Redis. Protobuf over NATS request/reply (`<prefix>.read.get`,
//! `.read.batch`, `.read.place`, queue group `storage-read` so any replica
//! answers), with the outcomes of sweeps and the sweeps held
//! (`.read.sweeps`) and the outbox entries kept aside as unpublishable
//! (`.read.dead`); JSON over HTTP with `data` and `state` decoded:
//!
//! - `GET  /v1/records/{brand}/{place}/{product}` → record, or 404
//! - `POST /v1/records/{brand}/{place}` with `{"product_ids": [...]}` → `{records, missing}`
//! - `GET  /v1/places/{brand}/{place}/records?cursor=C&limit=N` → `{records, next_cursor}`
//!   (no cursor to start, then the previous page's `next_cursor`, null on the
//!   last page; pages follow a scan of the place: no order, a page may hold
//!   fewer than N records before the end, and a record may come twice, so
//!   clients dedupe by product id — see `Store::page`). `after=ID` (pages in
//!   product id order, before) is refused with a 400 that points to
//!   `cursor`; `next_after` stays in the answer, not null while pages remain,
//!   so that a client of `after` asks again and is told so rather than take
//!   the first page for the whole place.
//! - `GET  /v1/stats` → this process's counters (commands, changes, ...)
//! - `GET  /healthz` (200 while the process runs), `GET /readyz` (503 until
//!   every owned partition's consumer is bound, while draining on shutdown,
//!   and when Redis does not answer), `GET /metrics` (Prometheus): the
//!   shared probes ([`probes`]), served with the read API
//!
//! Page sizes and batches are bounded by `storage.read_max_batch`; bad keys
//! get a 400 (or a `ReadReply.error`) that says what is wrong.
//!
//! With `storage.read_tokens_file` / `read_tokens_env` set, the `/v1/`
//! routes ask for one of those bearer tokens (401 without, 403 with
//! another); the probes and `/metrics` stay open (Prometheus and the
//! kubelet scrape them; they carry counts, no record). Over NATS the read
//! subjects are guarded by the NATS users' permissions instead.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use prost::Message;
use serde::Deserialize;
use serde_json::json;
use shelfsync_bus::{Partition, Subjects};
use shelfsync_proto::json::record_to_json;
use shelfsync_proto::{
    DeadEntriesReply, DeadEntriesRequest, DeadEntry, PlaceKey, ReadReply, ReadRequest, Record,
    SweepsReply, SweepsRequest,
};
use shelfsync_service::{ApiTokens, Drain, Probes, Readiness};
use shelfsync_settings::StorageSettings;
use shelfsync_telemetry::chain;
use tracing::{error, warn};

use crate::readiness::PartitionHealth;
use crate::store::{Store, StoreError};

/// Why a read was refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    #[error("{0}")]
    BadRequest(String),
    #[error("storage unavailable: {0}")]
    Store(#[from] StoreError),
}

impl IntoResponse for ReadError {
    fn into_response(self) -> Response {
        let status = match &self {
            ReadError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ReadError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
        };
        (status, Json(json!({ "error": self.to_string() }))).into_response()
    }
}

/// The read side of storage; cheap to clone.
#[derive(Clone)]
pub(crate) struct ReadApi {
    store: Store,
    storage: Arc<StorageSettings>,
    stats: Arc<crate::Stats>,
    /// The bearer tokens of the HTTP API (`None`: open).
    tokens: Option<Arc<ApiTokens>>,
}

/// The HTTP read API's tokens from `storage.read_tokens_file` /
/// `read_tokens_env` (`None`: none configured). Storage checks them when it
/// builds, so a bad file stops the start.
pub(crate) fn read_tokens(storage: &StorageSettings) -> anyhow::Result<Option<ApiTokens>> {
    ApiTokens::load(
        "shelfsync-storage",
        storage.read_tokens_file.as_deref(),
        storage.read_tokens_env.as_deref(),
        |var| std::env::var(var).ok(),
    )
}

fn check_product_id(id: &str) -> Result<(), ReadError> {
    if id.is_empty() || id.len() > 512 {
        return Err(ReadError::BadRequest(format!(
            "product id must be 1 to 512 bytes, got {} bytes",
            id.len()
        )));
    }
    Ok(())
}

impl ReadApi {
    pub(crate) fn new(
        store: Store,
        storage: Arc<StorageSettings>,
        stats: Arc<crate::Stats>,
    ) -> Self {
        // Checked at start (`App::build`); should the file have become
        // unreadable since, nothing is served rather than everything.
        let tokens = match read_tokens(&storage) {
            Ok(tokens) => tokens.map(Arc::new),
            Err(e) => {
                error!(error = %format!("{e:#}"), "cannot load the read API's tokens: it refuses every request");
                Some(Arc::new(ApiTokens::none("shelfsync-storage")))
            }
        };
        Self { store, storage, stats, tokens }
    }

    fn partitions(&self) -> u32 {
        self.storage.partitions
    }

    pub(crate) async fn get(&self, place: PlaceKey, id: &str) -> Result<Option<Record>, ReadError> {
        check_product_id(id)?;
        let key = shelfsync_proto::RecordKey::new(place.brand_id, place.place_id, id);
        Ok(self.store.get(self.partitions(), &key).await?)
    }

    /// Records of one place in the order asked, and the ids that are missing.
    pub(crate) async fn batch(
        &self,
        place: PlaceKey,
        ids: &[String],
    ) -> Result<(Vec<Record>, Vec<String>), ReadError> {
        let max = self.storage.read_max_batch;
        if ids.is_empty() {
            return Err(ReadError::BadRequest("no product ids given".into()));
        }
        if ids.len() > max {
            return Err(ReadError::BadRequest(format!(
                "a batch of {} keys exceeds the limit of {max}",
                ids.len()
            )));
        }
        for id in ids {
            check_product_id(id)?;
        }
        let found = self.store.get_many(self.partitions(), place, ids).await?;
        let mut records = Vec::new();
        let mut missing = Vec::new();
        for (id, r) in ids.iter().zip(found) {
            match r {
                Some(r) => records.push(r),
                None => missing.push(id.clone()),
            }
        }
        Ok((records, missing))
    }

    /// One page of a place's records, at most `limit`, from `cursor` (empty:
    /// the start), and the cursor of the next page (`None`: done). `after`,
    /// the old contract's product id, is refused when set.
    pub(crate) async fn page(
        &self,
        place: PlaceKey,
        cursor: &str,
        after: &str,
        limit: usize,
    ) -> Result<(Vec<Record>, Option<String>), ReadError> {
        let max = self.storage.read_max_batch;
        if limit == 0 || limit > max {
            return Err(ReadError::BadRequest(format!("limit must be 1 to {max}, got {limit}")));
        }
        if !after.is_empty() {
            return Err(ReadError::BadRequest(
                "`after` (a product id) is no longer supported: pages follow an opaque `cursor`; \
                 start without one and pass each page's `next_cursor`"
                    .into(),
            ));
        }
        match self.store.page(self.partitions(), place, cursor, limit).await {
            Err(StoreError::BadCursor(why)) => Err(ReadError::BadRequest(why)),
            r => Ok(r?),
        }
    }

    /// The outcomes of an import's sweeps of some places, or every sweep
    /// held now (see `SweepsRequest`).
    pub(crate) async fn sweeps(&self, req: &SweepsRequest) -> Result<SweepsReply, ReadError> {
        let mut reply = SweepsReply::default();
        if req.import_id.is_empty() {
            for p in 0..self.partitions() {
                for o in self.store.held_all(Partition(p)).await? {
                    let brand = o.sweep.as_ref().map_or(0, |s| s.brand_id);
                    if req.brand_id == 0 || brand == req.brand_id {
                        reply.outcomes.push(o);
                    }
                }
            }
            reply.outcomes.sort_by_key(|o| o.sweep.as_ref().map(|s| (s.brand_id, s.place_id)));
            return Ok(reply);
        }
        if req.place_ids.len() > self.storage.read_max_batch.max(10_000) {
            return Err(ReadError::BadRequest("too many places in one request".into()));
        }
        let mut by_partition: std::collections::BTreeMap<Partition, Vec<PlaceKey>> =
            Default::default();
        for &place_id in &req.place_ids {
            let place = PlaceKey::new(req.brand_id, place_id);
            by_partition.entry(Partition::of(place, self.partitions())).or_default().push(place);
        }
        for (p, places) in by_partition {
            let found = self.store.sweep_outcomes(p, &req.import_id, &places).await?;
            for (place, o) in places.into_iter().zip(found) {
                match o {
                    Some(o) => reply.outcomes.push(o),
                    None => reply.pending.push(place.place_id),
                }
            }
        }
        Ok(reply)
    }

    /// Outbox entries kept aside as unpublishable, the newest `limit` per
    /// partition, payloads cut at 64 KiB, the reply bounded under the
    /// server's payload limit.
    pub(crate) async fn dead(&self, limit: usize) -> Result<DeadEntriesReply, ReadError> {
        // Kept aside for being too large, entries may not fit in one reply:
        // payloads over this are cut (the metadata stays whole), and the
        // reply stops before the server's limit.
        const PAYLOAD_CUT: usize = 64 * 1024;
        const REPLY_MAX: usize = 768 * 1024;
        let mut reply = DeadEntriesReply::default();
        let mut size = 0;
        for p in 0..self.partitions() {
            for mut entry in self.store.dead_entries(Partition(p), limit).await? {
                entry.payload.truncate(PAYLOAD_CUT);
                size += entry.encoded_len() + 16;
                if size > REPLY_MAX {
                    return Ok(reply);
                }
                reply.entries.push(DeadEntry { partition: p, entry: Some(entry) });
            }
        }
        Ok(reply)
    }

    /// The encoded reply to a request on `<prefix>.read.<what>`.
    async fn answer_bytes(&self, what: &str, payload: &[u8]) -> Vec<u8> {
        match what {
            "sweeps" => match SweepsRequest::decode(payload) {
                Ok(req) => self
                    .sweeps(&req)
                    .await
                    .unwrap_or_else(|e| SweepsReply { error: e.to_string(), ..Default::default() }),
                Err(e) => {
                    SweepsReply { error: format!("bad SweepsRequest: {e}"), ..Default::default() }
                }
            }
            .encode_to_vec(),
            "dead" => match DeadEntriesRequest::decode(payload) {
                Ok(req) => {
                    let limit = if req.limit == 0 { 100 } else { req.limit as usize };
                    self.dead(limit).await.unwrap_or_else(|e| DeadEntriesReply {
                        error: e.to_string(),
                        ..Default::default()
                    })
                }
                Err(e) => DeadEntriesReply {
                    error: format!("bad DeadEntriesRequest: {e}"),
                    ..Default::default()
                },
            }
            .encode_to_vec(),
            _ => self.answer(what, payload).await.encode_to_vec(),
        }
    }

    async fn answer(&self, what: &str, payload: &[u8]) -> ReadReply {
        let req = match ReadRequest::decode(payload) {
            Ok(r) => r,
            Err(e) => {
                return ReadReply { error: format!("bad ReadRequest: {e}"), ..Default::default() };
            }
        };
        let result = match what {
            "get" => match req.product_ids.as_slice() {
                [id] => self.get(req.place(), id).await.map(|r| match r {
                    Some(r) => ReadReply { records: vec![r], ..Default::default() },
                    None => ReadReply { missing: vec![id.clone()], ..Default::default() },
                }),
                ids => Err(ReadError::BadRequest(format!(
                    "get takes exactly one product id, got {}",
                    ids.len()
                ))),
            },
            "batch" => self
                .batch(req.place(), &req.product_ids)
                .await
                .map(|(records, missing)| ReadReply { records, missing, ..Default::default() }),
            _ => {
                let limit = if req.limit == 0 { 100 } else { req.limit as usize };
                self.page(req.place(), &req.cursor, &req.after, limit).await.map(
                    |(records, next)| ReadReply {
                        records,
                        next_after: next.as_ref().map_or("", |_| OLD_CONTRACT_NEXT).into(),
                        next_cursor: next.unwrap_or_default(),
                        ..Default::default()
                    },
                )
            }
        };
        result.unwrap_or_else(|e| ReadReply { error: e.to_string(), ..Default::default() })
    }

    /// Serves the NATS subjects until `stop` starts.
    pub(crate) async fn serve_nats(
        self,
        client: async_nats::Client,
        subjects: Subjects,
        stop: Drain,
    ) {
        let subscribe = |what: &'static str| {
            let client = client.clone();
            let subject = subjects.read(what);
            async move {
                client
                    .queue_subscribe(subject, "storage-read".into())
                    .await
                    .map(|s| s.map(move |m| (what, m)))
            }
        };
        let subs = futures::future::try_join_all(
            ["get", "batch", "place", "sweeps", "dead"].map(subscribe),
        )
        .await;
        let mut all = match subs {
            Ok(s) => futures::stream::select_all(s),
            Err(e) => {
                error!(error = %chain(&e), "cannot subscribe to the read subjects");
                return;
            }
        };
        loop {
            let (what, msg) = tokio::select! {
                m = all.next() => match m { Some(m) => m, None => return },
                _ = stop.started() => return,
            };
            let Some(reply_to) = msg.reply.clone() else { continue };
            let api = self.clone();
            let client = client.clone();
            tokio::spawn(async move {
                let reply = api.answer_bytes(what, &msg.payload).await;
                if let Err(e) = client.publish(reply_to, reply.into()).await {
                    warn!(error = %chain(&e), "cannot send read reply");
                }
            });
        }
    }

    /// The HTTP read API (`/v1/`, behind the read tokens when set): the
    /// app merges it with the shared probes and serves both.
    pub(crate) fn router(self) -> Router {
        let api = Router::new()
            .route(
                "/v1/stats",
                get(|State(api): State<ReadApi>| async move { Json(api.stats.to_json()) }),
            )
            .route("/v1/records/{brand}/{place}/{product}", get(http_get))
            .route("/v1/records/{brand}/{place}", post(http_batch))
            .route("/v1/places/{brand}/{place}/records", get(http_page))
            .with_state(self.clone());
        shelfsync_service::protect(api, self.tokens)
    }
}

/// Storage's `/healthz`, `/readyz` and `/metrics`: ready while `health`
/// says so and Redis answers a `PING` (otherwise 503, empty body).
pub(crate) fn probes(health: Arc<PartitionHealth>, store: Store) -> Probes {
    Probes::new(move || Readiness::from_bool(health.is_ready())).check(move || {
        let store = store.clone();
        async move { Readiness::from_bool(store.answers().await) }
    })
}

fn parse_place(brand: &str, place: &str) -> Result<PlaceKey, ReadError> {
    let n = |what: &str, v: &str| {
        v.parse::<i64>()
            .map_err(|_| ReadError::BadRequest(format!("{what} must be an integer, got {v:?}")))
    };
    Ok(PlaceKey::new(n("brand", brand)?, n("place", place)?))
}

async fn http_get(
    State(api): State<ReadApi>,
    Path((brand, place, product)): Path<(String, String, String)>,
) -> Result<Response, ReadError> {
    let place = parse_place(&brand, &place)?;
    Ok(match api.get(place, &product).await? {
        Some(r) => Json(record_to_json(&r)).into_response(),
        None => (StatusCode::NOT_FOUND, Json(json!({"error": "record not found"}))).into_response(),
    })
}

#[derive(Deserialize)]
struct BatchBody {
    product_ids: Vec<String>,
}

async fn http_batch(
    State(api): State<ReadApi>,
    Path((brand, place)): Path<(String, String)>,
    body: Result<Json<BatchBody>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, ReadError> {
    let place = parse_place(&brand, &place)?;
    let Json(body) = body.map_err(|e| ReadError::BadRequest(format!("body: {e}")))?;
    let (records, missing) = api.batch(place, &body.product_ids).await?;
    let records: Vec<_> = records.iter().map(record_to_json).collect();
    Ok(Json(json!({ "records": records, "missing": missing })).into_response())
}

/// `next_after` while pages remain: what a client of the old contract
/// (pages after a product id) passes back as `after`, to be refused with a
/// pointer to `cursor`.
const OLD_CONTRACT_NEXT: &str = "(use next_cursor)";

#[derive(Deserialize)]
struct PageQuery {
    #[serde(default)]
    cursor: Option<String>,
    #[serde(default)]
    after: Option<String>,
    #[serde(default)]
    limit: Option<String>,
}

async fn http_page(
    State(api): State<ReadApi>,
    Path((brand, place)): Path<(String, String)>,
    Query(q): Query<PageQuery>,
) -> Result<Response, ReadError> {
    let place = parse_place(&brand, &place)?;
    let limit = match q.limit {
        None => 100,
        Some(s) => s
            .parse::<usize>()
            .map_err(|_| ReadError::BadRequest("limit must be a non-negative integer".into()))?,
    };
    let (cursor, after) = (q.cursor.as_deref().unwrap_or(""), q.after.as_deref().unwrap_or(""));
    let (records, next) = api.page(place, cursor, after, limit).await?;
    let records: Vec<_> = records.iter().map(record_to_json).collect();
    let old_next = next.as_ref().map(|_| OLD_CONTRACT_NEXT);
    Ok(Json(json!({ "records": records, "next_cursor": next, "next_after": old_next }))
        .into_response())
}
