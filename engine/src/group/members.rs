//! Named members and claim holders, interned so a claim carries a small id.
//!
//! A member is a (principal, name) pair, interned once. A holder is a
//! (member, connection) pair with at least one claim or reservation; claims
//! from anonymous callers have holder 0. Reclaim needs to know, per claim,
//! which member holds it and from which connection.

use std::collections::HashMap;

use ahash::RandomState;

use super::slot::HOLDER_MAX;

pub(super) type FastMap<K, V> = HashMap<K, V, RandomState>;

/// Fixed seeds: behaviour never depends on a random hash order.
pub(super) fn fast_map<K, V>() -> FastMap<K, V> {
    HashMap::with_hasher(RandomState::with_seeds(
        0x9e37_79b9_7f4a_7c15,
        0xbf58_476d_1ce4_e5b9,
        0x94d0_49bb_1331_11eb,
        0x2545_f491_4f6c_dd1d,
    ))
}

/// Members kept with no claims before the table is swept. A swept member
/// forgets its last reclaiming connection, which matters only if an older
/// connection of it later reclaims while an even older one still holds
/// claims; the sweep bounds memory against clients inventing names.
const IDLE_MEMBERS_MAX: usize = 4096;

#[derive(Debug)]
struct Member {
    principal: String,
    name: String,
    /// The newest connection that reclaimed for this member.
    last_reclaim: Option<u64>,
    /// Holders (connections with claims) of this member.
    holders: u32,
    live: bool,
}

#[derive(Debug, Clone, Copy)]
struct Holder {
    member: u32,
    connection: u64,
    /// Slots naming this holder.
    refs: u32,
    live: bool,
}

#[derive(Debug)]
pub(super) struct Members {
    members: Vec<Member>,
    member_free: Vec<u32>,
    member_ids: FastMap<String, FastMap<String, u32>>,
    /// Index 0 is the "nobody" sentinel and is never handed out.
    holders: Vec<Holder>,
    holder_free: Vec<u32>,
    holder_ids: FastMap<(u32, u64), u32>,
}

impl Members {
    pub(super) fn new() -> Members {
        Members {
            members: Vec::new(),
            member_free: Vec::new(),
            member_ids: fast_map(),
            holders: vec![Holder {
                member: u32::MAX,
                connection: 0,
                refs: 0,
                live: false,
            }],
            holder_free: Vec::new(),
            holder_ids: fast_map(),
        }
    }

    pub(super) fn member(&self, principal: &str, name: &str) -> Option<u32> {
        self.member_ids.get(principal)?.get(name).copied()
    }

    pub(super) fn intern_member(&mut self, principal: &str, name: &str) -> u32 {
        if let Some(id) = self.member(principal, name) {
            return id;
        }
        if self.members.len() - self.member_free.len() >= IDLE_MEMBERS_MAX {
            self.sweep_idle_members();
        }
        let m = Member {
            principal: principal.to_string(),
            name: name.to_string(),
            last_reclaim: None,
            holders: 0,
            live: true,
        };
        let id = match self.member_free.pop() {
            Some(id) => {
                self.members[id as usize] = m;
                id
            }
            None => {
                self.members.push(m);
                (self.members.len() - 1) as u32
            }
        };
        self.member_ids
            .entry(principal.to_string())
            .or_insert_with(fast_map)
            .insert(name.to_string(), id);
        id
    }

    fn sweep_idle_members(&mut self) {
        self.sweep(|m| m.holders == 0);
    }

    /// Drop the live members `gone` picks (they must hold nothing).
    fn sweep(&mut self, gone: impl Fn(&Member) -> bool) {
        for id in 0..self.members.len() {
            let m = &mut self.members[id];
            if m.live && gone(m) {
                debug_assert_eq!(m.holders, 0);
                m.live = false;
                let (principal, name) = (
                    std::mem::take(&mut m.principal),
                    std::mem::take(&mut m.name),
                );
                if let Some(names) = self.member_ids.get_mut(&principal) {
                    names.remove(&name);
                    if names.is_empty() {
                        self.member_ids.remove(&principal);
                    }
                }
                self.member_free.push(id as u32);
            }
        }
    }

    /// The newest connection that reclaimed for `member`.
    pub(super) fn last_reclaim(&self, member: u32) -> Option<u64> {
        self.members[member as usize].last_reclaim
    }

    pub(super) fn set_last_reclaim(&mut self, member: u32, connection: u64) {
        self.members[member as usize].last_reclaim = Some(connection);
    }

    pub(super) fn holder(&self, member: u32, connection: u64) -> Option<u32> {
        self.holder_ids.get(&(member, connection)).copied()
    }

    /// The holder for (member, connection), created with no references: the
    /// caller must `acquire` it (by putting it in a slot) at once.
    pub(super) fn intern_holder(&mut self, member: u32, connection: u64) -> u32 {
        if let Some(id) = self.holder(member, connection) {
            return id;
        }
        let h = Holder {
            member,
            connection,
            refs: 0,
            live: true,
        };
        let id = match self.holder_free.pop() {
            Some(id) => {
                self.holders[id as usize] = h;
                id
            }
            None => {
                self.holders.push(h);
                (self.holders.len() - 1) as u32
            }
        };
        assert!(id <= HOLDER_MAX, "more than {HOLDER_MAX} claim holders");
        self.members[member as usize].holders += 1;
        self.holder_ids.insert((member, connection), id);
        id
    }

    /// (member, connection) of a live holder.
    pub(super) fn holder_of(&self, id: u32) -> (u32, u64) {
        let h = &self.holders[id as usize];
        assert!(id != 0 && h.live, "holder {id} is not live");
        (h.member, h.connection)
    }

    pub(super) fn acquire(&mut self, id: u32) {
        let h = &mut self.holders[id as usize];
        assert!(id != 0 && h.live, "acquiring dead holder {id}");
        h.refs += 1;
    }

    pub(super) fn release(&mut self, id: u32) {
        let h = &mut self.holders[id as usize];
        assert!(
            id != 0 && h.live && h.refs > 0,
            "releasing holder {id} with no references"
        );
        h.refs -= 1;
        if h.refs == 0 {
            h.live = false;
            let (member, connection) = (h.member, h.connection);
            self.holder_ids.remove(&(member, connection));
            self.holder_free.push(id);
            self.members[member as usize].holders -= 1;
        }
    }

    /// Every slot is gone (seek, delete, rebuild): drop holders, keep members
    /// and their last reclaiming connections.
    pub(super) fn clear_holders(&mut self) {
        self.holders.truncate(1);
        self.holder_free.clear();
        self.holder_ids.clear();
        for m in &mut self.members {
            m.holders = 0;
        }
    }

    /// Eviction: drop every holder, and every member but those that
    /// reclaimed (a connection older than the last one to reclaim must
    /// still never take anything back, nor that one reclaim twice).
    pub(super) fn keep_only_reclaims(&mut self) {
        self.clear_holders();
        self.sweep(|m| m.last_reclaim.is_none());
    }

    /// References per live holder, for the invariant check.
    pub(super) fn live_holder_refs(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.holders
            .iter()
            .enumerate()
            .filter(|(_, h)| h.live)
            .map(|(id, h)| (id as u32, h.refs))
    }

    pub(super) fn check(&self) {
        let mut per_member = vec![0u32; self.members.len()];
        for (id, h) in self.holders.iter().enumerate().skip(1) {
            if h.live {
                assert!(h.refs > 0, "live holder {id} has no references");
                assert_eq!(
                    self.holder_ids.get(&(h.member, h.connection)),
                    Some(&(id as u32))
                );
                assert!(
                    self.members[h.member as usize].live,
                    "holder {id} of a swept member"
                );
                per_member[h.member as usize] += 1;
            }
        }
        for (id, m) in self.members.iter().enumerate() {
            if m.live {
                assert_eq!(m.holders, per_member[id], "member {id} holder count");
                assert_eq!(self.member(&m.principal, &m.name), Some(id as u32));
            }
        }
        assert_eq!(
            self.holder_ids.len(),
            self.holders.iter().filter(|h| h.live).count()
        );
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.members.capacity() * std::mem::size_of::<Member>()
            + self
                .members
                .iter()
                .map(|m| m.principal.capacity() + m.name.capacity())
                .sum::<usize>()
            + self.holders.capacity() * std::mem::size_of::<Holder>()
            + self.holder_ids.capacity() * (std::mem::size_of::<((u32, u64), u32)>() + 1)
    }
}
