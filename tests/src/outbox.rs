//! Storage's outbox at the store, with no storage running: commits of
//! placeholder entries, for the tests of fencing, order and trims.

use shelfsync_bus::Partition;
use shelfsync_proto::{OutboxEntry, msg_type};
use shelfsync_storage::client::Store;
use shelfsync_storage::client::{Commit, Fence, Position, Writes};

/// `n` entries of an outbox, as a commit to sequence `seq` writes them
/// (message ids `chg:0:{seq}:{part}`).
pub fn outbox_entries(seq: u64, n: u32) -> Vec<OutboxEntry> {
    (0..n)
        .map(|part| OutboxEntry {
            subject: "x".into(),
            msg_id: format!("chg:0:{seq}:{part}"),
            payload: vec![part as u8; 3].into(),
            msg_type: msg_type::CHANGE_BATCH.into(),
            ..Default::default()
        })
        .collect()
}

/// Commits `n` outbox entries (and nothing else) to `partition`, fenced
/// at sequence `from`, moving it to `to`.
pub async fn commit_outbox(
    store: &Store,
    partition: Partition,
    from: u64,
    to: u64,
    n: u32,
) -> Commit {
    let outbox = outbox_entries(to, n);
    let fence = Fence { at: Position::at(from), stream: String::new() };
    let writes = Writes { outbox: &outbox, ..Default::default() };
    store.commit(partition, &fence, &Position::at(to), &writes).await.expect("commit")
}
