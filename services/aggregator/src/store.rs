//! Redis: where the aggregates live. Owns the key layout and the two Lua
//! scripts; knows nothing of NATS or of qualification rules.
//!
//! Every key of one aggregate shares a hash tag, so each script touches one
//! slot and runs unchanged on Redis Cluster:
//!
//! | key | type | holds |
//! |---|---|---|
//! | `{ns:agg:card:<region>:<product>}:z` | zset | member `<brand>:<place>` (sortable hex) → price |
//! | `{ns:agg:card:<region>:<product>}:o` | hash | member → `<price>:<currency>` |
//! | `{ns:agg:card:<region>:<product>}:pub` | hash | `card` (last published `MasterCard`), `ver` |
//! | `{ns:agg:cat:<brand>:<place>}:view` | hash | product_id → what was counted (`Seen`, JSON) |
//! | `{ns:agg:cat:<brand>:<place>}:c:<category>` | set | product ids of qualifying offers |
//! | `{ns:agg:cat:<brand>:<place>}:ne` | set | categories last published non-empty |
//! | `{ns:agg:cat:<brand>:<place>}:ver` | hash | category → version of its last flip |
//! | `{ns:agg}:dirty` | set | aggregates changed but not yet published (`Dirty`, JSON) |
//!
//! (`<region>` is escaped so that a `:` in it cannot make two cards share
//! keys.) A retracted card's `pub` hash expires after a while: its version
//! only has to outlive the JetStream duplicate window.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use prost::Message;
use redis::{Pipeline, ServerErrorKind, Value};
use shelfsync_proto::MasterCard;
use shelfsync_redis::group_by_slot;
use shelfsync_settings::RedisSettings;
use shelfsync_telemetry::chain;
use tracing::warn;

use crate::aggregate::{
    CardChange, CardId, CardOp, CardOutcome, CardWork, CategoryOutcome, Cheapest, Dirty, Flip,
    PlaceKey, PlaceWork, Seen, master_card, member, offer_entry, parse_member, parse_offer_entry,
};

/// The shared Redis connection: standalone or cluster, TLS by config.
pub use shelfsync_redis::RedisConn;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("unexpected redis reply: {0}")]
    Reply(#[from] redis::ParsingError),
    #[error("script failed: {0}")]
    Script(String),
}

/// Applies one card's operations in order, then reads what the card is now
/// and what was last published — one atomic step per aggregate.
///
/// KEYS: 1 zset of qualifying offers, 2 hash member → entry, 3 published.
/// ARGV: groups of 4: `P` (put) or `R` (remove), member, price, entry.
const CARD_LUA: &str = r#"
for i = 1, #ARGV, 4 do
  local m = ARGV[i + 1]
  if ARGV[i] == 'P' then
    redis.call('ZADD', KEYS[1], ARGV[i + 2], m)
    redis.call('HSET', KEYS[2], m, ARGV[i + 3])
  else
    redis.call('ZREM', KEYS[1], m)
    redis.call('HDEL', KEYS[2], m)
  end
end
local n = redis.call('ZCARD', KEYS[1])
local top = redis.call('ZRANGE', KEYS[1], 0, 0)
local m, entry = false, false
if top[1] then
  m = top[1]
  entry = redis.call('HGET', KEYS[2], m)
end
local pub = redis.call('HMGET', KEYS[3], 'card', 'ver')
return {n, m, entry, pub[1], pub[2]}
"#;

/// Applies one place's category moves and remembers what was counted, in
/// order, then reads each touched category's size and published state.
///
/// KEYS: 1 view, 2 published non-empty set, 3 versions, 3+i the set of
/// category i. ARGV[1] = k categories, ARGV[2..k+1] their names, then groups
/// of 4: product id, index of the category left (0: none), index of the
/// category joined (0: none), what to remember ('' = forget).
const PLACE_LUA: &str = r#"
local k = tonumber(ARGV[1])
for i = k + 2, #ARGV, 4 do
  local id = ARGV[i]
  local rem, add = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  if rem > 0 then redis.call('SREM', KEYS[3 + rem], id) end
  if add > 0 then redis.call('SADD', KEYS[3 + add], id) end
  if ARGV[i + 3] == '' then
    redis.call('HDEL', KEYS[1], id)
  else
    redis.call('HSET', KEYS[1], id, ARGV[i + 3])
  end
end
local out = {}
for c = 1, k do
  local name = ARGV[1 + c]
  out[c] = {redis.call('SCARD', KEYS[3 + c]), redis.call('SISMEMBER', KEYS[2], name),
            redis.call('HGET', KEYS[3], name)}
end
return out
"#;

/// Largest number of arguments of one `SADD` / `SREM`.
const CHUNK: usize = 1000;
/// On a cluster, most per-slot pipelines in flight at once.
const SLOT_PIPELINES: usize = 32;

/// Key names; every aggregate under its own hash tag.
#[derive(Debug, Clone)]
pub struct Keys {
    ns: String,
}

/// `:` and `%` escaped, so that `<region>:<product>` is unambiguous.
fn escape(s: &str) -> std::borrow::Cow<'_, str> {
    if s.contains([':', '%']) { s.replace('%', "%25").replace(':', "%3A").into() } else { s.into() }
}

impl Keys {
    pub fn new(namespace: &str) -> Self {
        Self { ns: namespace.to_string() }
    }
    fn card_tag(&self, id: &CardId) -> String {
        format!("{{{}:agg:card:{}:{}}}", self.ns, escape(&id.region), id.product_id)
    }
    pub fn card_offers(&self, id: &CardId) -> String {
        format!("{}:z", self.card_tag(id))
    }
    pub fn card_entries(&self, id: &CardId) -> String {
        format!("{}:o", self.card_tag(id))
    }
    pub fn card_published(&self, id: &CardId) -> String {
        format!("{}:pub", self.card_tag(id))
    }
    fn place_tag(&self, place: PlaceKey) -> String {
        format!("{{{}:agg:cat:{}:{}}}", self.ns, place.brand_id, place.place_id)
    }
    pub fn view(&self, place: PlaceKey) -> String {
        format!("{}:view", self.place_tag(place))
    }
    pub fn category(&self, place: PlaceKey, category: &str) -> String {
        format!("{}:c:{category}", self.place_tag(place))
    }
    pub fn non_empty(&self, place: PlaceKey) -> String {
        format!("{}:ne", self.place_tag(place))
    }
    pub fn versions(&self, place: PlaceKey) -> String {
        format!("{}:ver", self.place_tag(place))
    }
    pub fn dirty(&self) -> String {
        format!("{{{}:agg}}:dirty", self.ns)
    }
}

/// The aggregator's handle on Redis.
#[derive(Clone)]
pub struct Store {
    conn: RedisConn,
    keys: Keys,
    card_script: redis::Script,
    place_script: redis::Script,
}

fn decode_seen(key: &str, id: &str, raw: &str) -> Option<Seen> {
    match serde_json::from_str(raw) {
        Ok(s) => Some(s),
        Err(e) => {
            // Only this process writes it; treat garbage as "never counted".
            warn!(key, product_id = id, error = %chain(&e), "unreadable offer view entry ignored");
            None
        }
    }
}

impl Store {
    pub async fn connect(cfg: &RedisSettings) -> Result<Store, StoreError> {
        let store = Store {
            conn: RedisConn::connect(cfg).await?,
            keys: Keys::new(&cfg.namespace),
            card_script: redis::Script::new(CARD_LUA),
            place_script: redis::Script::new(PLACE_LUA),
        };
        store.load_scripts().await?;
        Ok(store)
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    async fn load_scripts(&self) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        self.card_script.load_async(&mut conn).await?;
        self.place_script.load_async(&mut conn).await?;
        Ok(())
    }

    /// Runs a pipeline of script invocations (EVALSHA); if Redis lost the
    /// scripts (restart, failover), loads them and runs it again — every
    /// script is idempotent, so a partial first run is harmless.
    async fn run_scripts(&self, pipe: &Pipeline) -> Result<Vec<Value>, StoreError> {
        let mut conn = self.conn.clone();
        let mut reloaded = false;
        loop {
            let values: Vec<Value> = pipe.query_async(&mut conn).await?;
            let mut no_script = false;
            for v in &values {
                if let Value::ServerError(e) = v {
                    if e.kind() == Some(ServerErrorKind::NoScript) {
                        no_script = true;
                    } else {
                        return Err(StoreError::Script(format!("{}: {:?}", e.code(), e.details())));
                    }
                }
            }
            if !no_script {
                return Ok(values);
            }
            if reloaded {
                return Err(StoreError::Script("NOSCRIPT after loading the scripts".into()));
            }
            self.load_scripts().await?;
            reloaded = true;
        }
    }

    /// What was counted for the given records (absent: never counted).
    pub async fn views(
        &self,
        wanted: &BTreeMap<PlaceKey, Vec<String>>,
    ) -> Result<HashMap<(PlaceKey, String), Seen>, StoreError> {
        let wanted: Vec<(&PlaceKey, &Vec<String>)> = wanted.iter().collect();
        let values = self
            .by_slot(
                &wanted,
                |(place, _)| self.keys.view(**place),
                |pipe, (place, ids)| {
                    pipe.cmd("HMGET").arg(self.keys.view(**place)).arg(*ids);
                },
                false,
            )
            .await?;
        let mut out = HashMap::new();
        for ((place, ids), v) in wanted.into_iter().zip(values) {
            let raw: Vec<Option<String>> = redis::from_redis_value(v)?;
            for (id, raw) in ids.iter().zip(raw) {
                if let Some(seen) = raw.and_then(|r| decode_seen(&self.keys.view(*place), id, &r)) {
                    out.insert((*place, id.clone()), seen);
                }
            }
        }
        Ok(out)
    }

    /// Every record counted for a place: product id → `updated_at`.
    pub async fn counted(&self, place: PlaceKey) -> Result<HashMap<String, i64>, StoreError> {
        let key = self.keys.view(place);
        let mut conn = self.conn.clone();
        let mut out = HashMap::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, page): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
                .arg(&key)
                .arg(cursor)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await?;
            for (id, raw) in page {
                // Unreadable: counted long ago (forgotten at the reload's end).
                let at = decode_seen(&key, &id, &raw).map_or(i64::MIN, |s| s.updated_at);
                out.insert(id, at);
            }
            if next == 0 {
                return Ok(out);
            }
            cursor = next;
        }
    }

    /// Records aggregates as possibly changed, before their sets move.
    pub async fn mark_dirty(&self, dirty: &[Dirty]) -> Result<(), StoreError> {
        if dirty.is_empty() {
            return Ok(());
        }
        self.dirty_set("SADD", dirty).await
    }

    /// Adds (`SADD`) or removes (`SREM`) aggregates in the dirty set, in
    /// chunks of one pipeline.
    async fn dirty_set(&self, op: &str, dirty: &[Dirty]) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        for chunk in dirty.chunks(CHUNK) {
            let members: Vec<String> = chunk.iter().map(Dirty::encode).collect();
            pipe.cmd(op).arg(self.keys.dirty()).arg(members).ignore();
        }
        let mut conn = self.conn.clone();
        pipe.query_async::<()>(&mut conn).await?;
        Ok(())
    }

    /// Aggregates left dirty by an interrupted batch.
    pub async fn dirty(&self) -> Result<Vec<Dirty>, StoreError> {
        let mut conn = self.conn.clone();
        let raw: Vec<String> =
            redis::cmd("SMEMBERS").arg(self.keys.dirty()).query_async(&mut conn).await?;
        Ok(raw.iter().filter_map(|r| Dirty::decode(r)).collect())
    }

    /// Runs every card's operations; returns each card as it now stands.
    pub async fn apply_cards(
        &self,
        cards: &BTreeMap<CardId, CardWork>,
    ) -> Result<Vec<CardOutcome>, StoreError> {
        let cards: Vec<(&CardId, &CardWork)> = cards.iter().collect();
        let values = self
            .by_slot(
                &cards,
                |(id, _)| self.keys.card_offers(id),
                |pipe, (id, work)| {
                    let mut inv = self.card_script.prepare_invoke();
                    inv.key(self.keys.card_offers(id))
                        .key(self.keys.card_entries(id))
                        .key(self.keys.card_published(id));
                    for op in &work.ops {
                        match op {
                            CardOp::Put { place, price, currency } => {
                                inv.arg("P")
                                    .arg(member(*place))
                                    .arg(*price)
                                    .arg(offer_entry(*price, currency.as_deref()));
                            }
                            CardOp::Remove { place } => {
                                inv.arg("R").arg(member(*place)).arg("").arg("");
                            }
                        }
                    }
                    pipe.invoke_script(&inv);
                },
                true,
            )
            .await?;
        let mut out = Vec::with_capacity(cards.len());
        for ((id, work), v) in cards.into_iter().zip(values) {
            type Reply = (u64, Option<String>, Option<String>, Option<Vec<u8>>, Option<u64>);
            let (n, top, entry, published, version): Reply = redis::from_redis_value(v)?;
            let cheapest = match (top, entry) {
                (Some(m), Some(e)) => {
                    let place = parse_member(&m);
                    let offer = parse_offer_entry(&e);
                    match (place, offer) {
                        (Some(place), Some((price, currency))) => {
                            Some(Cheapest { place, price, currency })
                        }
                        _ => {
                            return Err(StoreError::Script(format!(
                                "bad offer {m:?} = {e:?} in {}",
                                self.keys.card_entries(id)
                            )));
                        }
                    }
                }
                _ => None,
            };
            let published = published.and_then(|b| MasterCard::decode(b.as_slice()).ok());
            out.push(CardOutcome {
                id: id.clone(),
                current: master_card(id, if cheapest.is_some() { n } else { 0 }, cheapest.as_ref()),
                published,
                version: version.unwrap_or(0),
                at: work.at,
            });
        }
        Ok(out)
    }

    /// Runs every place's category moves and view writes; returns each
    /// touched category as it now stands.
    pub async fn apply_places(
        &self,
        places: &BTreeMap<PlaceKey, PlaceWork>,
    ) -> Result<Vec<CategoryOutcome>, StoreError> {
        let places: Vec<(&PlaceKey, &PlaceWork)> = places.iter().collect();
        let values = self
            .by_slot(
                &places,
                |(place, _)| self.keys.view(**place),
                |pipe, (place, work)| {
                    let index: HashMap<&str, usize> = work
                        .categories
                        .keys()
                        .enumerate()
                        .map(|(i, c)| (c.as_str(), i + 1))
                        .collect();
                    let mut inv = self.place_script.prepare_invoke();
                    inv.key(self.keys.view(**place))
                        .key(self.keys.non_empty(**place))
                        .key(self.keys.versions(**place));
                    for c in work.categories.keys() {
                        inv.key(self.keys.category(**place, c));
                    }
                    inv.arg(work.categories.len());
                    for c in work.categories.keys() {
                        inv.arg(c.as_str());
                    }
                    let idx = |c: &Option<String>| {
                        c.as_deref().and_then(|c| index.get(c)).copied().unwrap_or(0)
                    };
                    for op in &work.ops {
                        let seen = op
                            .seen
                            .as_ref()
                            .map(|s| serde_json::to_string(s).unwrap_or_default())
                            .unwrap_or_default();
                        inv.arg(op.product_id.as_str())
                            .arg(idx(&op.remove))
                            .arg(idx(&op.add))
                            .arg(seen);
                    }
                    pipe.invoke_script(&inv);
                },
                true,
            )
            .await?;
        let mut out = Vec::new();
        for ((place, work), v) in places.into_iter().zip(values) {
            let rows: Vec<(u64, u64, Option<u64>)> = redis::from_redis_value(v)?;
            for ((category, at), (count, published, version)) in work.categories.iter().zip(rows) {
                out.push(CategoryOutcome {
                    place: *place,
                    category: category.clone(),
                    count,
                    published: published == 1,
                    version: version.unwrap_or(0),
                    at: *at,
                });
            }
        }
        Ok(out)
    }

    /// Stores what was published and clears the dirty marks of the batch.
    /// `retracted_ttl`: how long a retracted card's version is kept.
    pub async fn commit(
        &self,
        cards: &[CardChange],
        flips: &[Flip],
        done: &[Dirty],
        retracted_ttl: Duration,
    ) -> Result<(), StoreError> {
        if cards.is_empty() && flips.is_empty() && done.is_empty() {
            return Ok(());
        }
        enum Write<'a> {
            Card(&'a CardChange),
            Flip(&'a Flip),
        }
        let writes: Vec<Write> =
            cards.iter().map(Write::Card).chain(flips.iter().map(Write::Flip)).collect();
        let key = |w: &Write| match w {
            Write::Card(c) => self.keys.card_published(&c.id),
            Write::Flip(f) => self.keys.non_empty(f.place),
        };
        self.by_slot(
            &writes,
            key,
            |pipe, w| match w {
                Write::Card(c) => {
                    let key = self.keys.card_published(&c.id);
                    pipe.cmd("HSET")
                        .arg(&key)
                        .arg("card")
                        .arg(c.card.encode_to_vec())
                        .arg("ver")
                        .arg(c.version)
                        .ignore();
                    if c.card.offers == 0 {
                        pipe.cmd("PEXPIRE")
                            .arg(&key)
                            .arg(retracted_ttl.as_millis() as u64)
                            .ignore();
                    } else {
                        pipe.cmd("PERSIST").arg(&key).ignore();
                    }
                }
                Write::Flip(f) => {
                    let op = if f.non_empty { "SADD" } else { "SREM" };
                    pipe.cmd(op).arg(self.keys.non_empty(f.place)).arg(&f.category).ignore();
                    pipe.cmd("HSET")
                        .arg(self.keys.versions(f.place))
                        .arg(&f.category)
                        .arg(f.version)
                        .ignore();
                }
            },
            false,
        )
        .await?;
        // Only once what was published is stored: a mark cleared too early
        // would leave an aggregate unchecked after a crash.
        if !done.is_empty() {
            self.dirty_set("SREM", done).await?;
        }
        Ok(())
    }

    /// Runs `items` in pipelines that each stay on one hash slot — a Redis
    /// Cluster refuses a pipeline whose keys span slots, even when each of its
    /// commands touches one key — and in one pipeline on a single Redis.
    /// `key` names the item's slot; `add` puts the item's commands in a
    /// pipeline, at most one of them not ignored. With `scripts`, the
    /// commands are script invocations (see [`Store::run_scripts`]).
    /// Returns the replies in the items' order (`Nil` for an item whose
    /// commands are all ignored).
    async fn by_slot<T>(
        &self,
        items: &[T],
        key: impl Fn(&T) -> String,
        add: impl Fn(&mut Pipeline, &T),
        scripts: bool,
    ) -> Result<Vec<Value>, StoreError> {
        if items.is_empty() {
            // An empty pipeline is an error, not an empty answer.
            return Ok(Vec::new());
        }
        let groups: Vec<Vec<usize>> = if self.conn.is_cluster() {
            let keyed: Vec<(usize, String)> = items.iter().map(&key).enumerate().collect();
            group_by_slot(keyed, |(_, k)| k.as_bytes())
                .into_values()
                .map(|group| group.into_iter().map(|(i, _)| i).collect())
                .collect()
        } else {
            vec![(0..items.len()).collect()]
        };
        let runs = groups.into_iter().map(|group| {
            let mut pipe = redis::pipe();
            if scripts {
                pipe.ignore_errors();
            }
            for &i in &group {
                add(&mut pipe, &items[i]);
            }
            async move {
                let values = if scripts {
                    self.run_scripts(&pipe).await?
                } else {
                    pipe.query_async::<Vec<Value>>(&mut self.conn.clone()).await?
                };
                Ok::<_, StoreError>((group, values))
            }
        });
        let done: Vec<(Vec<usize>, Vec<Value>)> =
            futures::stream::iter(runs).buffer_unordered(SLOT_PIPELINES).try_collect().await?;
        let mut out = vec![Value::Nil; items.len()];
        for (group, values) in done {
            for (i, v) in group.into_iter().zip(values) {
                out[i] = v;
            }
        }
        Ok(out)
    }

    /// The last published card (`None`: never published, or expired after
    /// its retraction).
    pub async fn card(&self, id: &CardId) -> Result<Option<MasterCard>, StoreError> {
        let mut conn = self.conn.clone();
        let raw: Option<Vec<u8>> = redis::cmd("HGET")
            .arg(self.keys.card_published(id))
            .arg("card")
            .query_async(&mut conn)
            .await?;
        Ok(raw.and_then(|b| MasterCard::decode(b.as_slice()).ok()))
    }

    /// A place's categories last published non-empty, sorted.
    pub async fn categories(&self, place: PlaceKey) -> Result<Vec<String>, StoreError> {
        let mut conn = self.conn.clone();
        let mut out: Vec<String> =
            redis::cmd("SMEMBERS").arg(self.keys.non_empty(place)).query_async(&mut conn).await?;
        out.sort();
        Ok(out)
    }
}
