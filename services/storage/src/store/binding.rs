//! Which command stream a partition's applied sequence counts in: bound
//! at each start of its worker, and the operator's ways out when it is
//! refused (`shelfsync rebase`: a re-base, or the drop of a half-applied
//! message's step).

use shelfsync_bus::Partition;

use super::{Store, StoreError, StreamBinding};

/// Adopts the command stream a partition's sequence counts in: ARGV[1] is
/// its identity. Returns `adopted` when none was recorded (a new partition,
/// or one written by a version that did not record it) or when nothing was
/// applied yet (KEYS[2], the sequence, is 0 and KEYS[3], the step, unset:
/// nothing can be mistaken for applied), `same`, or else the identity
/// recorded, which differs: the stream was replaced.
const BIND_STREAM_LUA: &str = r#"
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then return 'same' end
local fresh = (redis.call('GET', KEYS[2]) or '0') == '0' and redis.call('EXISTS', KEYS[3]) == 0
if not cur or fresh then redis.call('SET', KEYS[1], ARGV[1]); return 'adopted' end
return cur
"#;

/// The script of [`Store::bind_stream`].
pub(super) fn bind_script() -> redis::Script {
    redis::Script::new(BIND_STREAM_LUA)
}

impl Store {
    /// Records the command stream the partition's sequence counts in, or
    /// says that it counts in another one.
    pub async fn bind_stream(
        &self,
        partition: Partition,
        identity: &str,
    ) -> Result<StreamBinding, StoreError> {
        let mut conn = self.conn.clone();
        let keys = self.keys(partition);
        let answer: String = self
            .bind_script
            .key(keys.stream())
            .key(keys.seq())
            .key(keys.step())
            .arg(identity)
            .invoke_async(&mut conn)
            .await?;
        Ok(match answer.as_str() {
            "adopted" | "same" => StreamBinding::Same,
            _ => StreamBinding::Replaced { recorded: answer },
        })
    }

    /// An operator's re-base: the partition's sequence now counts in the
    /// stream `identity`, with every message up to `applied` taken as
    /// applied. A message half applied in steps starts over.
    pub async fn rebase(
        &self,
        partition: Partition,
        identity: &str,
        applied: u64,
    ) -> Result<(), StoreError> {
        let keys = self.keys(partition);
        let mut conn = self.conn.clone();
        let () = redis::pipe()
            .atomic()
            .set(keys.stream(), identity)
            .ignore()
            .set(keys.seq(), applied)
            .ignore()
            .del(keys.step())
            .ignore()
            .query_async(&mut conn)
            .await?;
        Ok(())
    }

    /// An operator's drop of a half-applied message's step (the message is
    /// gone from the command stream): the step goes if it still is `step`;
    /// the applied sequence and the stream stay. `false`: it changed since.
    pub async fn drop_step(&self, partition: Partition, step: &str) -> Result<bool, StoreError> {
        let keys = self.keys(partition);
        let mut conn = self.conn.clone();
        let dropped: i64 = redis::Script::new(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end \
             return 0",
        )
        .key(keys.step())
        .arg(step)
        .invoke_async(&mut conn)
        .await?;
        Ok(dropped == 1)
    }
}
