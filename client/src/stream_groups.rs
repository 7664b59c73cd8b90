//! The rules of the group calls on every shard of a stream
//! (`group_*_stream`), shared by [`Client`](crate::Client) and
//! [`ClusterClient`](crate::ClusterClient), which make the per-shard calls.
//!
//! A group comes into being shard by shard, on its first poll there, so a
//! group in use on a stream may be missing from some of its shards. And a
//! call can fail on one shard and not on the others. So each stream-wide
//! call makes its call on every shard whatever the others answered, and
//! then:
//! * a delete counts a shard without the group as done (nothing to delete);
//! * a seek creates the group at the position on a shard without it, so
//!   every shard is where the seek said (a later first poll there would
//!   otherwise start at offset 0), provided the seek found it on another
//!   shard (with the rest failing it may exist nowhere: a mistyped name);
//! * a describe gives a shard without the group as a first poll will make
//!   it: at the shard's start, owing every record the shard holds, so that
//!   the stream's lag counts them;
//! * a delete, seek or describe of a group on no shard at all is
//!   `not_found` (and the seek creates nothing);
//! * a failure on any shard fails the call with the first failure, in shard
//!   order, its message naming its shard and the shards the call was done
//!   on.

use crate::{ClientError, Result};
use felix_wire::{ErrorCode, GroupInfo, ShardInfo};

/// Whether a per-shard group call failed because the group is not on
/// that shard.
pub(crate) fn group_missing(e: &ClientError) -> bool {
    e.code() == Some(ErrorCode::NotFound)
}

/// A delete, seek or describe that found the group on no shard of the
/// stream.
pub(crate) fn nowhere(stream: &str, group: &str) -> ClientError {
    ClientError::Server {
        code: ErrorCode::NotFound,
        message: format!("group {group} does not exist on any shard of {stream}"),
        // Found missing everywhere: nothing was changed.
        not_applied: true,
    }
}

/// A group on a shard it has not polled yet, described as its first poll
/// there will make it: at the shard's start, nothing in play.
pub(crate) fn not_yet_polled(group: &str, shard: &ShardInfo) -> GroupInfo {
    GroupInfo {
        group: group.to_string(),
        position: shard.start_offset,
        end_offset: shard.end_offset,
        start_offset: shard.start_offset,
        in_flight: 0,
        owed: 0,
        delayed: 0,
        dead_letters: 0,
        oldest_in_flight_age_ms: None,
        oldest_owed_age_ms: None,
        last_active_ms: None,
    }
}

/// A stream-wide call's outcome from each shard's, in shard order: `Ok`
/// when every shard's call succeeded, else the first failure, naming its
/// shard and the shards the call was done on.
pub(crate) fn settle(results: Vec<Result<()>>) -> Result<()> {
    let done: Vec<String> = results
        .iter()
        .enumerate()
        .filter(|(_, r)| r.is_ok())
        .map(|(shard, _)| shard.to_string())
        .collect();
    let Some((shard, first)) = results
        .into_iter()
        .enumerate()
        .find_map(|(shard, r)| r.err().map(|e| (shard, e)))
    else {
        return Ok(());
    };
    if done.is_empty() {
        return Err(first.noted(&format!("shard {shard}; done on no shard")));
    }
    // Done on some shards: the call as a whole did something, whatever the
    // failing shard's part says.
    let done = format!("done on shard(s) {}", done.join(", "));
    Err(first.noted(&format!("shard {shard}; {done}")).partly_done())
}

/// The four `group_*_stream` calls, for a client type with the per-shard
/// group calls, `describe_shard`, and `$shards(tenant, namespace, stream,
/// start)` giving the stream's shard count (an offset refused for more
/// than one shard).
macro_rules! stream_group_calls {
    ($shards:ident) => {
        /// [`group_create`](Self::group_create) on every shard of the stream,
        /// one call per shard (`Latest` is each shard's own tail when its call
        /// lands). Every shard is tried; a failure on any fails the call,
        /// naming its shard and those the group was created on.
        pub async fn group_create_stream(
            &self,
            tenant: &str,
            namespace: &str,
            stream: &str,
            group: &str,
            start: felix_wire::StartPosition,
        ) -> $crate::Result<()> {
            let shards = self.$shards(tenant, namespace, stream, Some(start)).await?;
            let mut results = Vec::with_capacity(shards as usize);
            for shard in 0..shards {
                results.push(
                    self.group_create(tenant, namespace, stream, shard, group, start)
                        .await,
                );
            }
            $crate::stream_groups::settle(results)
        }

        /// [`group_seek`](Self::group_seek) on every shard of the stream. On a
        /// shard the group has not polled yet (it does not exist there) it is
        /// created at `start`, when another shard's seek found it; a group on
        /// no shard is `not_found`. Every shard is tried; a failure on any
        /// fails the call, naming its shard and those the group was moved on.
        pub async fn group_seek_stream(
            &self,
            tenant: &str,
            namespace: &str,
            stream: &str,
            group: &str,
            start: felix_wire::StartPosition,
        ) -> $crate::Result<()> {
            let shards = self.$shards(tenant, namespace, stream, Some(start)).await?;
            let mut results = Vec::with_capacity(shards as usize);
            let mut missing = Vec::new();
            for shard in 0..shards {
                match self
                    .group_seek(tenant, namespace, stream, shard, group, start)
                    .await
                {
                    Err(e) if $crate::stream_groups::group_missing(&e) => missing.push(shard),
                    r => results.push((shard, r)),
                }
            }
            if missing.len() == shards as usize {
                return Err($crate::stream_groups::nowhere(
                    &format!("{tenant}/{namespace}/{stream}"),
                    group,
                ));
            }
            // Created only beside a shard that proved the group exists: with
            // the others failing, it may exist nowhere (a mistyped name).
            if !results.iter().any(|(_, r)| r.is_ok()) {
                missing.clear();
            }
            for shard in missing {
                // Created where the seek puts it; the seek after it moves it
                // there even if a first poll created it meanwhile.
                let r = match self
                    .group_create(tenant, namespace, stream, shard, group, start)
                    .await
                {
                    Ok(()) => {
                        self.group_seek(tenant, namespace, stream, shard, group, start)
                            .await
                    }
                    e => e,
                };
                results.push((shard, r));
            }
            results.sort_by_key(|(shard, _)| *shard);
            $crate::stream_groups::settle(results.into_iter().map(|(_, r)| r).collect())
        }

        /// [`group_describe`](Self::group_describe) of every shard, in shard
        /// order. A shard the group has not polled yet (it does not exist
        /// there) is described as its first poll will make it: at the shard's
        /// start, owing every record the shard holds. A group on no shard is
        /// `not_found`.
        pub async fn group_describe_stream(
            &self,
            tenant: &str,
            namespace: &str,
            stream: &str,
            group: &str,
        ) -> $crate::Result<Vec<felix_wire::GroupInfo>> {
            let shards = self.$shards(tenant, namespace, stream, None).await?;
            let mut described = Vec::with_capacity(shards as usize);
            for shard in 0..shards {
                match self
                    .group_describe(tenant, namespace, stream, shard, group)
                    .await
                {
                    Ok(info) => described.push(Some(info)),
                    Err(e) if $crate::stream_groups::group_missing(&e) => described.push(None),
                    Err(e) => return Err(e.noted(&format!("shard {shard}"))),
                }
            }
            if described.iter().all(Option::is_none) {
                return Err($crate::stream_groups::nowhere(
                    &format!("{tenant}/{namespace}/{stream}"),
                    group,
                ));
            }
            let mut out = Vec::with_capacity(shards as usize);
            for (shard, info) in (0..shards).zip(described) {
                out.push(match info {
                    Some(info) => info,
                    None => {
                        let held = self
                            .describe_shard(tenant, namespace, stream, shard)
                            .await
                            .map_err(|e| e.noted(&format!("shard {shard}")))?;
                        $crate::stream_groups::not_yet_polled(group, &held)
                    }
                });
            }
            Ok(out)
        }

        /// [`group_delete`](Self::group_delete) on every shard of the stream. A
        /// shard without the group counts as done; a group on no shard is
        /// `not_found`. Every shard is tried; a failure on any fails the call,
        /// naming its shard and those the group was deleted on.
        pub async fn group_delete_stream(
            &self,
            tenant: &str,
            namespace: &str,
            stream: &str,
            group: &str,
        ) -> $crate::Result<()> {
            let shards = self.$shards(tenant, namespace, stream, None).await?;
            let mut results = Vec::with_capacity(shards as usize);
            let mut missing = 0;
            for shard in 0..shards {
                match self
                    .group_delete(tenant, namespace, stream, shard, group)
                    .await
                {
                    Err(e) if $crate::stream_groups::group_missing(&e) => {
                        missing += 1;
                        results.push(Ok(()));
                    }
                    r => results.push(r),
                }
            }
            if missing == shards {
                return Err($crate::stream_groups::nowhere(
                    &format!("{tenant}/{namespace}/{stream}"),
                    group,
                ));
            }
            $crate::stream_groups::settle(results)
        }
    };
}
pub(crate) use stream_group_calls;

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(code: ErrorCode, message: &str) -> ClientError {
        ClientError::Server {
            code,
            message: message.into(),
            not_applied: false,
        }
    }

    #[test]
    fn the_first_failure_names_its_shard_and_where_the_call_was_done() {
        assert!(settle(vec![Ok(()), Ok(())]).is_ok());
        let e = settle(vec![
            Ok(()),
            Err(refused(ErrorCode::TooLarge, "too many groups")),
            Ok(()),
            Err(refused(ErrorCode::NotFound, "no group")),
        ])
        .unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::TooLarge));
        assert_eq!(
            e.to_string(),
            "too_large: too many groups (shard 1; done on shard(s) 0, 2)"
        );
        let e = settle(vec![Err(refused(ErrorCode::Unauthorized, "no"))]).unwrap_err();
        assert!(
            e.to_string().ends_with("(shard 0; done on no shard)"),
            "{e}"
        );
        // A part that did nothing does not make the whole call "nothing
        // done" once another shard's part was done.
        let nothing = || ClientError::Server {
            code: ErrorCode::Unavailable,
            message: "stopping".into(),
            not_applied: true,
        };
        assert!(settle(vec![Err(nothing()), Err(nothing())])
            .unwrap_err()
            .not_applied());
        assert!(!settle(vec![Ok(()), Err(nothing())])
            .unwrap_err()
            .not_applied());
    }

    #[test]
    fn a_shard_not_yet_polled_owes_every_record_it_holds() {
        let shard = ShardInfo {
            stream: felix_wire::StreamRef::new("t", "n", "s"),
            shard: 1,
            core: 0,
            start_offset: 40,
            end_offset: 100,
            bytes: 0,
            segments: 1,
            stopped: None,
        };
        let g = not_yet_polled("g", &shard);
        assert_eq!(g.lag(), 60);
        assert_eq!((g.in_flight, g.owed, g.dead_letters), (0, 0, 0));
    }
}
