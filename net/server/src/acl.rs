//! Permissions: what each principal may do, from `security.acl_file`.
//!
//! Without the file every principal may do everything. With it, nothing is
//! allowed that a line does not grant. A line is
//! `PRINCIPAL PERMISSION RESOURCE`:
//!
//! * PRINCIPAL: a principal's name, or `*` for every principal.
//! * PERMISSION: `stream.publish`, `stream.subscribe`, `stream.manage`,
//!   `group.consume`, `group.manage`, or `*` for all of them.
//! * RESOURCE: `TENANT/NAMESPACE/STREAM`, or `group:TENANT/NAMESPACE/STREAM/GROUP`
//!   for one group's permissions only; any part may be `*`, and `*` alone
//!   is everything.
//!
//! As the queue guide has it, `stream.subscribe` also grants
//! `group.consume` on the stream's groups, and `stream.manage` also grants
//! `group.manage`.

use std::collections::HashMap;
use std::path::Path;

use felix_engine::types::validate_name;
use felix_wire::{Request, StreamRef};

/// A permission a request needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Perm {
    StreamPublish,
    StreamSubscribe,
    StreamManage,
    GroupConsume,
    GroupManage,
}

impl Perm {
    fn parse(s: &str) -> Option<Perm> {
        Some(match s {
            "stream.publish" => Perm::StreamPublish,
            "stream.subscribe" => Perm::StreamSubscribe,
            "stream.manage" => Perm::StreamManage,
            "group.consume" => Perm::GroupConsume,
            "group.manage" => Perm::GroupManage,
            _ => return None,
        })
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Perm::StreamPublish => "stream.publish",
            Perm::StreamSubscribe => "stream.subscribe",
            Perm::StreamManage => "stream.manage",
            Perm::GroupConsume => "group.consume",
            Perm::GroupManage => "group.manage",
        }
    }

    fn is_group(self) -> bool {
        matches!(self, Perm::GroupConsume | Perm::GroupManage)
    }

    /// Does holding `self` give `wanted`?
    fn gives(self, wanted: Perm) -> bool {
        self == wanted
            || matches!(
                (self, wanted),
                (Perm::StreamSubscribe, Perm::GroupConsume)
                    | (Perm::StreamManage, Perm::GroupManage)
            )
    }
}

/// One part of a resource: a name, or `*`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Any,
    Is(String),
}

impl Part {
    fn of(s: &str) -> Part {
        if s == "*" {
            Part::Any
        } else {
            Part::Is(s.to_string())
        }
    }

    fn matches(&self, s: &str) -> bool {
        match self {
            Part::Any => true,
            Part::Is(p) => p == s,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Resource {
    Everything,
    /// A stream and all its groups.
    Stream([Part; 3]),
    /// One group of a stream.
    Group([Part; 4]),
}

impl Resource {
    fn parse(s: &str) -> Option<Resource> {
        if s == "*" {
            return Some(Resource::Everything);
        }
        let (group, path) = match s.strip_prefix("group:") {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        let parts: Vec<Part> = path.split('/').map(Part::of).collect();
        // A part that is not `*` must be a name a stream or group can have
        // (so `jobs*` or an empty part, which could never match, is refused).
        let names_ok = parts.iter().all(|p| match p {
            Part::Any => true,
            Part::Is(name) => validate_name("name", name).is_ok(),
        });
        if !names_ok {
            return None;
        }
        match (group, parts.len()) {
            (false, 3) => Some(Resource::Stream(parts.try_into().ok()?)),
            (true, 4) => Some(Resource::Group(parts.try_into().ok()?)),
            _ => None,
        }
    }

    fn covers_stream(parts: &[Part], s: &StreamRef) -> bool {
        parts[0].matches(&s.tenant) && parts[1].matches(&s.namespace) && parts[2].matches(&s.stream)
    }

    /// Does this cover `stream` (and `group`, when the request names one)?
    fn covers(&self, stream: &StreamRef, group: Option<&str>) -> bool {
        match self {
            Resource::Everything => true,
            Resource::Stream(p) => Resource::covers_stream(p, stream),
            Resource::Group(p) => {
                Resource::covers_stream(p, stream) && group.is_some_and(|g| p[3].matches(g))
            }
        }
    }

    /// Does this name `stream` or one of its groups at all?
    fn touches(&self, stream: &StreamRef) -> bool {
        match self {
            Resource::Everything => true,
            Resource::Stream(p) => Resource::covers_stream(p, stream),
            Resource::Group(p) => Resource::covers_stream(p, stream),
        }
    }
}

#[derive(Debug, Clone)]
struct Grant {
    /// `None`: every permission.
    perm: Option<Perm>,
    resource: Resource,
}

/// The permissions of `security.acl_file`.
#[derive(Debug, Default)]
pub(crate) struct Acl {
    by_principal: HashMap<String, Vec<Grant>>,
    /// Lines for `*`: every principal.
    everyone: Vec<Grant>,
    lines: usize,
}

impl Acl {
    pub(crate) fn load(path: &Path) -> Result<Acl, String> {
        crate::auth::load_file(path, "security.acl_file", Acl::parse)
    }

    pub(crate) fn parse(text: &str) -> Result<Acl, String> {
        let mut acl = Acl::default();
        for (n, line) in crate::auth::content_lines(text) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let [principal, perm, resource] = f[..] else {
                return Err(format!(
                    "line {n}: expected `PRINCIPAL PERMISSION RESOURCE`, found {line:?}"
                ));
            };
            let perm = match perm {
                "*" => None,
                p => Some(Perm::parse(p).ok_or_else(|| {
                    format!(
                        "line {n}: unknown permission {p:?} (stream.publish, stream.subscribe, \
                         stream.manage, group.consume, group.manage or *)"
                    )
                })?),
            };
            let resource = Resource::parse(resource).ok_or_else(|| {
                format!(
                    "line {n}: {resource:?} is not a resource (TENANT/NAMESPACE/STREAM or \
                     group:TENANT/NAMESPACE/STREAM/GROUP, each part a name of letters, digits, \
                     '.', '_', '-' or * alone; or * for everything)"
                )
            })?;
            if let (Some(p), Resource::Group(_)) = (perm, &resource) {
                if !p.is_group() {
                    return Err(format!(
                        "line {n}: {} is a stream permission; a group: resource takes \
                         group.consume or group.manage",
                        p.as_str()
                    ));
                }
            }
            let grant = Grant { perm, resource };
            match principal {
                "*" => acl.everyone.push(grant),
                p => acl
                    .by_principal
                    .entry(p.to_string())
                    .or_default()
                    .push(grant),
            }
            acl.lines += 1;
        }
        if acl.lines == 0 {
            return Err(
                "grants nothing (every call would be refused); to run without \
                 permission checks, leave security.acl_file empty"
                    .into(),
            );
        }
        Ok(acl)
    }

    /// The principals the file names (not `*`).
    pub(crate) fn principals(&self) -> impl Iterator<Item = &str> {
        self.by_principal.keys().map(String::as_str)
    }

    /// How many grants the file holds.
    pub(crate) fn len(&self) -> usize {
        self.lines
    }

    fn grants<'a>(&'a self, principal: &str) -> impl Iterator<Item = &'a Grant> + 'a {
        self.by_principal
            .get(principal)
            .into_iter()
            .flatten()
            .chain(&self.everyone)
    }

    /// May `principal` do `perm` on `stream` (`group`: the group a group
    /// request names)?
    pub(crate) fn allows(
        &self,
        principal: &str,
        perm: Perm,
        stream: &StreamRef,
        group: Option<&str>,
    ) -> bool {
        self.grants(principal)
            .any(|g| g.perm.is_none_or(|p| p.gives(perm)) && g.resource.covers(stream, group))
    }

    /// Does `principal` hold anything on `stream` or its groups (to see it
    /// listed and described)?
    pub(crate) fn sees(&self, principal: &str, stream: &StreamRef) -> bool {
        self.grants(principal).any(|g| g.resource.touches(stream))
    }

    /// Why `principal` may not send `req`, if it may not.
    pub(crate) fn refuses(&self, principal: &str, req: &Request) -> Option<String> {
        let (perm, stream, group) = match needs(req)? {
            Need::Perm(perm, stream, group) => (perm, stream, group),
            Need::Sees(stream) => {
                if self.sees(principal, stream) {
                    return None;
                }
                return Some(format!(
                    "{principal} holds no permission on {stream} or its groups"
                ));
            }
        };
        if self.allows(principal, perm, stream, group) {
            return None;
        }
        // The resource as a permissions file would name it.
        Some(match group {
            Some(g) => format!(
                "{principal} may not {} on group:{stream}/{g}",
                perm.as_str()
            ),
            None => format!("{principal} may not {} on {stream}", perm.as_str()),
        })
    }
}

/// What a request needs.
enum Need<'a> {
    Perm(Perm, &'a StreamRef, Option<&'a str>),
    /// Any permission on the stream or one of its groups.
    Sees(&'a StreamRef),
}

/// The permission each request needs (`None`: none, or checked by
/// filtering its answer).
fn needs(req: &Request) -> Option<Need<'_>> {
    use Perm::*;
    Some(match req {
        // Which brokers make up the cluster is no secret: a `not_leader`
        // answer names the leader's address to anyone.
        Request::Hello { .. }
        | Request::Ping
        | Request::DescribeCluster
        | Request::ListStreams { .. } => return None,
        Request::CreateStream { stream, .. } | Request::DeleteStream { stream } => {
            Need::Perm(StreamManage, stream, None)
        }
        Request::DescribeStream { stream }
        | Request::DescribeShard { stream, .. }
        | Request::DescribeReplica { stream, .. } => Need::Sees(stream),
        Request::ListGroups { stream, .. } => Need::Sees(stream),
        Request::Publish { stream, .. } => Need::Perm(StreamPublish, stream, None),
        Request::Read { stream, .. } => Need::Perm(StreamSubscribe, stream, None),
        Request::GroupPoll { key, .. }
        | Request::GroupAck { key, .. }
        | Request::GroupNack { key, .. }
        | Request::GroupExtend { key, .. }
        | Request::GroupDeadLetter { key, .. }
        | Request::GroupDeadLetters { key }
        | Request::GroupDeadLettersPage { key, .. }
        | Request::GroupDescribe { key } => Need::Perm(GroupConsume, &key.stream, Some(&key.group)),
        Request::GroupRedrive { key, .. }
        | Request::GroupDiscard { key, .. }
        | Request::GroupCreate { key, .. }
        | Request::GroupSeek { key, .. }
        | Request::GroupDelete { key } => Need::Perm(GroupManage, &key.stream, Some(&key.group)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use felix_wire::GroupKey;

    fn s(t: &str, n: &str, st: &str) -> StreamRef {
        StreamRef::new(t, n, st)
    }

    fn key(stream: StreamRef, group: &str) -> GroupKey {
        GroupKey {
            stream,
            shard: 0,
            group: group.into(),
        }
    }

    const FILE: &str = "\
# producers write one tenant's streams
ingest   stream.publish    t1/*/*
# a worker pool runs one group
worker   group.consume     group:t1/jobs/queue/workers
# the dashboard reads everything of t1
dash     stream.subscribe  t1/*/*
ops      stream.manage     *
admin    *                 *
*        stream.subscribe  public/*/*
";

    #[test]
    fn grants_imply_what_the_guide_says() {
        let acl = Acl::parse(FILE).unwrap();
        assert_eq!(acl.len(), 6);
        let q = s("t1", "jobs", "queue");
        assert!(acl.allows("ingest", Perm::StreamPublish, &q, None));
        assert!(!acl.allows("ingest", Perm::StreamSubscribe, &q, None));
        assert!(!acl.allows(
            "ingest",
            Perm::StreamPublish,
            &s("t2", "jobs", "queue"),
            None
        ));
        // A group grant is for that group only, and not for reading the stream.
        assert!(acl.allows("worker", Perm::GroupConsume, &q, Some("workers")));
        assert!(!acl.allows("worker", Perm::GroupConsume, &q, Some("others")));
        assert!(!acl.allows("worker", Perm::GroupManage, &q, Some("workers")));
        assert!(!acl.allows("worker", Perm::StreamSubscribe, &q, None));
        assert!(acl.sees("worker", &q));
        assert!(!acl.sees("worker", &s("t1", "jobs", "other")));
        // stream.subscribe grants group.consume, not group.manage.
        assert!(acl.allows("dash", Perm::GroupConsume, &q, Some("any")));
        assert!(!acl.allows("dash", Perm::GroupManage, &q, Some("any")));
        // stream.manage grants group.manage.
        assert!(acl.allows("ops", Perm::GroupManage, &q, Some("any")));
        assert!(!acl.allows("ops", Perm::StreamPublish, &q, None));
        assert!(acl.allows("admin", Perm::StreamPublish, &q, None));
        // `*` principals: everyone, and nobody else gets anything.
        let public = s("public", "news", "feed");
        assert!(acl.allows("stranger", Perm::StreamSubscribe, &public, None));
        assert!(!acl.allows("stranger", Perm::StreamSubscribe, &q, None));
        assert!(!acl.sees("stranger", &q));
    }

    #[test]
    fn each_request_needs_its_permission() {
        let acl = Acl::parse(FILE).unwrap();
        let q = s("t1", "jobs", "queue");
        let poll = Request::GroupPoll {
            key: key(q.clone(), "workers"),
            max_records: 1,
            wait_ms: 0,
            member: None,
            visibility_ms: None,
        };
        assert_eq!(acl.refuses("worker", &poll), None);
        let redrive = Request::GroupRedrive {
            key: key(q.clone(), "workers"),
            offset: 0,
        };
        assert_eq!(
            acl.refuses("worker", &redrive).unwrap(),
            "worker may not group.manage on group:t1/jobs/queue/workers"
        );
        assert_eq!(acl.refuses("ops", &redrive), None);
        let delete = Request::DeleteStream { stream: q.clone() };
        assert_eq!(
            acl.refuses("ingest", &delete).unwrap(),
            "ingest may not stream.manage on t1/jobs/queue"
        );
        let describe = Request::DescribeStream { stream: q.clone() };
        assert_eq!(acl.refuses("worker", &describe), None);
        assert!(acl
            .refuses("stranger", &describe)
            .unwrap()
            .contains("no permission"));
        assert_eq!(acl.refuses("stranger", &Request::Ping), None);
    }

    /// Every request and what it needs, from the guide: a request moved to
    /// the wrong permission fails here.
    #[test]
    fn every_request_needs_what_the_guide_says() {
        use felix_wire::{AckMode, PublishTarget, StartPosition};
        let st = s("t", "n", "s");
        let k = || key(st.clone(), "g");
        let cases: Vec<(Request, Option<Perm>)> = vec![
            (Request::Ping, None),
            (Request::DescribeCluster, None),
            (Request::ListStreams { tenant: None }, None),
            (
                Request::CreateStream {
                    stream: st.clone(),
                    shards: 1,
                    retention_bytes: None,
                    retention_ms: None,
                    incarnation: None,
                },
                Some(Perm::StreamManage),
            ),
            (
                Request::DeleteStream { stream: st.clone() },
                Some(Perm::StreamManage),
            ),
            (
                Request::Publish {
                    stream: st.clone(),
                    target: PublishTarget::Shard(0),
                    ack: AckMode::Default,
                    records: Vec::new().into(),
                },
                Some(Perm::StreamPublish),
            ),
            (
                Request::Read {
                    stream: st.clone(),
                    shard: 0,
                    from: StartPosition::Earliest,
                    max_records: 1,
                    max_bytes: 1,
                    wait_ms: 0,
                },
                Some(Perm::StreamSubscribe),
            ),
            (
                Request::GroupPoll {
                    key: k(),
                    max_records: 1,
                    wait_ms: 0,
                    member: None,
                    visibility_ms: None,
                },
                Some(Perm::GroupConsume),
            ),
            (
                Request::GroupAck {
                    key: k(),
                    offsets: vec![0],
                },
                Some(Perm::GroupConsume),
            ),
            (
                Request::GroupNack {
                    key: k(),
                    offset: 0,
                    attempts: 1,
                    delay_ms: Some(5),
                    reason: None,
                },
                Some(Perm::GroupConsume),
            ),
            (
                Request::GroupExtend {
                    key: k(),
                    offset: 0,
                    attempts: 1,
                    extend_ms: 5,
                },
                Some(Perm::GroupConsume),
            ),
            (
                Request::GroupDeadLetter {
                    key: k(),
                    offset: 0,
                    attempts: 1,
                    reason: None,
                },
                Some(Perm::GroupConsume),
            ),
            (
                Request::GroupDeadLetters { key: k() },
                Some(Perm::GroupConsume),
            ),
            (
                Request::GroupDeadLettersPage {
                    key: k(),
                    from: 0,
                    max: 1,
                },
                Some(Perm::GroupConsume),
            ),
            (
                Request::GroupDescribe { key: k() },
                Some(Perm::GroupConsume),
            ),
            (
                Request::GroupRedrive {
                    key: k(),
                    offset: 0,
                },
                Some(Perm::GroupManage),
            ),
            (
                Request::GroupDiscard {
                    key: k(),
                    offset: 0,
                },
                Some(Perm::GroupManage),
            ),
            (
                Request::GroupCreate {
                    key: k(),
                    start: StartPosition::Earliest,
                },
                Some(Perm::GroupManage),
            ),
            (
                Request::GroupSeek {
                    key: k(),
                    start: StartPosition::Latest,
                },
                Some(Perm::GroupManage),
            ),
            (Request::GroupDelete { key: k() }, Some(Perm::GroupManage)),
        ];
        let all = [
            Perm::StreamPublish,
            Perm::StreamSubscribe,
            Perm::StreamManage,
            Perm::GroupConsume,
            Perm::GroupManage,
        ];
        for (req, wants) in cases {
            for p in all {
                // A principal holding exactly `p` on the group (group
                // permissions) or the stream (stream permissions).
                let res = if p.is_group() {
                    "group:t/n/s/g"
                } else {
                    "t/n/s"
                };
                let acl = Acl::parse(&format!("who {} {res}\n", p.as_str())).unwrap();
                let allowed = acl.refuses("who", &req).is_none();
                let expect = wants.is_none_or(|w| p.gives(w));
                assert_eq!(allowed, expect, "{} with {}", req.name(), p.as_str());
            }
        }
        // Describing a stream or a shard and listing groups: any grant
        // touching the stream, a group's included.
        let acl = Acl::parse("who group.consume group:t/n/s/g\n").unwrap();
        for req in [
            Request::DescribeStream { stream: st.clone() },
            Request::DescribeShard {
                stream: st.clone(),
                shard: 0,
            },
            Request::DescribeReplica {
                stream: st.clone(),
                shard: 0,
            },
            Request::ListGroups {
                stream: st.clone(),
                shard: 0,
            },
        ] {
            assert!(acl.refuses("who", &req).is_none(), "{}", req.name());
            assert!(acl.refuses("other", &req).is_some(), "{}", req.name());
        }
    }

    #[test]
    fn a_bad_acl_line_is_named() {
        for (text, wants) in [
            ("alice stream.publish\n", "line 1: expected"),
            (
                "alice stream.write t/n/s\n",
                "unknown permission \"stream.write\"",
            ),
            (
                "\nalice stream.publish t/n\n",
                "line 2: \"t/n\" is not a resource",
            ),
            ("alice stream.publish t//s\n", "is not a resource"),
            ("alice group.consume group:t/n/s\n", "is not a resource"),
            (
                "alice stream.publish group:t/n/s/g\n",
                "is a stream permission",
            ),
        ] {
            let e = Acl::parse(text).unwrap_err();
            assert!(e.contains(wants), "{text:?}: {e}");
        }
        // A BOM (some editors write one) is not part of the first principal.
        let acl = Acl::parse("\u{feff}alice stream.publish t/n/s\r\n").unwrap();
        assert!(acl.allows("alice", Perm::StreamPublish, &s("t", "n", "s"), None));
    }
}
