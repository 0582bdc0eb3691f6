//! The ChangeFeed handler: decides, per record version, whether the offer
//! belongs in the index, and applies the result. Owns the "what can be
//! recommended" rule; knows nothing of queries.
//!
//! An offer is indexed when it is offered (live, not hidden, stock > 0 —
//! `shelfsync_feed::is_offered`) and has a positive price; any other version
//! (sold out, hidden, swept absent, deleted, priceless) removes it.

use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use shelfsync_feed::{Handler, HandlerError, Update, is_visible};

use crate::index::{Index, Offer, PlaceKey};

/// The index shared by the feed (the only writer) and the query APIs.
#[derive(Debug, Clone, Default)]
pub struct SharedIndex(Arc<RwLock<Index>>);

impl SharedIndex {
    /// A poisoned lock still holds a consistent index: every mutation of
    /// `Index` completes or panics before touching anything.
    pub fn read(&self) -> RwLockReadGuard<'_, Index> {
        self.0.read().unwrap_or_else(|e| e.into_inner())
    }

    pub fn write(&self) -> RwLockWriteGuard<'_, Index> {
        self.0.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// What one record version does to the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Upsert { place: PlaceKey, product_id: String, offer: Offer },
    Remove { place: PlaceKey, product_id: String },
}

impl Op {
    pub fn of(u: &Update) -> Op {
        let place = PlaceKey::new(u.key.brand_id, u.key.place_id);
        let product_id = u.key.product_id.clone();
        if is_visible(&u.after) {
            let p = u.product();
            if let (Some(price), Some(stock)) = (p.price, p.stock)
                && price > 0
                && stock > 0
            {
                let offer = Offer {
                    category: p.category.unwrap_or_default(),
                    price,
                    old_price: p.old_price,
                    stock,
                };
                return Op::Upsert { place, product_id, offer };
            }
        }
        Op::Remove { place, product_id }
    }

    fn apply_to(self, index: &mut Index) {
        match self {
            Op::Upsert { place, product_id, offer } => index.upsert(place, &product_id, offer),
            Op::Remove { place, product_id } => {
                index.remove(place, &product_id);
            }
        }
    }
}

/// Updates applied per write-lock hold: bounds how long a query can wait
/// behind a keyframe part (1000 records) to a fraction of a millisecond.
const OPS_PER_LOCK: usize = 128;

/// Feeds the index from the change stream.
#[derive(Debug, Clone)]
pub struct IndexHandler {
    index: SharedIndex,
}

impl IndexHandler {
    pub fn new(index: SharedIndex) -> Self {
        Self { index }
    }
}

impl Handler for IndexHandler {
    async fn apply(&mut self, updates: &[Update]) -> Result<(), HandlerError> {
        // Decoding happens outside the lock; only tree operations inside.
        let mut ops = updates.iter().map(Op::of).peekable();
        while ops.peek().is_some() {
            let mut index = self.index.write();
            for op in ops.by_ref().take(OPS_PER_LOCK) {
                op.apply_to(&mut index);
            }
        }
        Ok(())
    }

    async fn reset_place(&mut self, place: PlaceKey) -> Result<(), HandlerError> {
        self.index.write().reset_place(place);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::Query;
    use prost::Message;
    use shelfsync_feed::UpdateKind;
    use shelfsync_proto::{Product, Record, RecordKey, RecordState};

    fn update(id: &str, product: Product, hidden: bool, absent: bool, deleted: bool) -> Update {
        let state = RecordState { hidden: Some(hidden), ..Default::default() };
        Update {
            key: RecordKey::new(7, 1, id),
            before: None,
            after: Record {
                data: product.encode_to_vec(),
                state: state.encode_to_vec(),
                absent,
                deleted,
                ..Default::default()
            },
            kind: UpdateKind::Updated,
            origin: None,
        }
    }

    fn product(price: Option<i64>, stock: Option<i64>) -> Product {
        Product {
            category: Some("roses".into()),
            price,
            old_price: Some(100),
            stock,
            ..Default::default()
        }
    }

    #[test]
    fn only_offered_priced_records_are_upserted() {
        let ok = product(Some(50), Some(2));
        let upsert = Op::of(&update("a", ok.clone(), false, false, false));
        assert_eq!(
            upsert,
            Op::Upsert {
                place: PlaceKey::new(7, 1),
                product_id: "a".into(),
                offer: Offer {
                    category: "roses".into(),
                    price: 50,
                    old_price: Some(100),
                    stock: 2
                },
            }
        );
        let removed = [
            update("a", ok.clone(), true, false, false), // hidden
            update("a", ok.clone(), false, true, false), // swept
            update("a", ok.clone(), false, false, true), // deleted
            update("a", product(Some(50), Some(0)), false, false, false), // sold out
            update("a", product(Some(50), None), false, false, false),
            update("a", product(None, Some(2)), false, false, false),
            update("a", product(Some(0), Some(2)), false, false, false),
        ];
        for u in &removed {
            assert!(matches!(Op::of(u), Op::Remove { .. }), "{u:?}");
        }
    }

    #[tokio::test]
    async fn the_handler_keeps_the_index_in_step() {
        let index = SharedIndex::default();
        let mut h = IndexHandler::new(index.clone());
        let many: Vec<Update> = (0..300)
            .map(|i| update(&format!("p{i:03}"), product(Some(50), Some(1)), false, false, false))
            .collect();
        h.apply(&many).await.expect("apply");
        assert_eq!(index.read().len(), 300);
        h.apply(&[update("p000", product(Some(50), Some(0)), false, false, false)])
            .await
            .expect("apply");
        let top = index
            .read()
            .top(PlaceKey::new(7, 1), Query { category: Some("roses"), limit: 1, exclude: &[] });
        assert_eq!(top[0].product_id, "p001");
        h.reset_place(PlaceKey::new(7, 1)).await.expect("reset");
        assert!(index.read().is_empty());
    }
}
