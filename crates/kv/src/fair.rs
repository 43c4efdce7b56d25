//! Fair shares of a KV tier among tenants: each tenant holding blocks is due
//! an equal share of the tier's bytes, and room for a put comes first from
//! tenants above their share — the putting tenant's own least recently
//! stored blocks when it is above, else the blocks of the tenant furthest
//! above. Below every share (or with one tenant) the tier's own policy
//! (least recently used) decides. A tenant may use room no one else needs;
//! it gives it back, oldest first, as others put. So one tenant flooding
//! a tier evicts its own blocks, not another's working set. The
//! kv-store's tiers and a worker's host and disk tiers keep such books.
//!
//! [`FairShare`] only keeps the books: the tier adds each block it stores
//! (with a stamp, unique per block stored) and removes each block it lets
//! go (from its eviction listener), asks for a [`victim`](FairShare::victim)
//! before it stores, and evicts it itself — never while holding the books'
//! lock, which its listener takes.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use crate::KvTenant;

/// Blocks evicted for fairness before one block is stored, at most (a
/// block another thread changed meanwhile ends the round sooner).
pub const EVICTIONS_PER_PUT: usize = 64;

/// One tenant's blocks in a tier.
#[derive(Debug)]
struct Held<K> {
    bytes: u64,
    /// Its blocks by stamp: the first is its least recently stored.
    order: BTreeMap<u64, K>,
}

impl<K> Default for Held<K> {
    fn default() -> Self {
        Self { bytes: 0, order: BTreeMap::new() }
    }
}

#[derive(Debug)]
struct Books<K> {
    tenants: FxHashMap<KvTenant, Held<K>>,
    bytes: u64,
}

impl<K> Default for Books<K> {
    fn default() -> Self {
        Self { tenants: FxHashMap::default(), bytes: 0 }
    }
}

/// The books of one tier's fair shares, its blocks named by `K`.
#[derive(Debug)]
pub struct FairShare<K> {
    capacity_bytes: u64,
    books: Mutex<Books<K>>,
    next_stamp: AtomicU64,
}

impl<K: Copy> FairShare<K> {
    /// The books of a tier holding at most `capacity_bytes`.
    pub fn new(capacity_bytes: u64) -> Self {
        Self { capacity_bytes, books: Mutex::default(), next_stamp: AtomicU64::new(1) }
    }

    /// A stamp for a block about to be stored (later blocks, higher stamps).
    pub fn stamp(&self) -> u64 {
        self.next_stamp.fetch_add(1, Relaxed)
    }

    /// Counts a block the tier stores (or is about to).
    pub fn add(&self, tenant: KvTenant, stamp: u64, key: K, bytes: u64) {
        let mut books = self.books.lock();
        books.bytes += bytes;
        let held = books.tenants.entry(tenant).or_default();
        held.bytes += bytes;
        held.order.insert(stamp, key);
    }

    /// Uncounts a block the tier no longer holds (a stamp not counted is
    /// ignored).
    pub fn remove(&self, tenant: KvTenant, stamp: u64, bytes: u64) {
        let mut books = self.books.lock();
        let Some(held) = books.tenants.get_mut(&tenant) else { return };
        if held.order.remove(&stamp).is_none() {
            return;
        }
        held.bytes = held.bytes.saturating_sub(bytes);
        let empty = held.order.is_empty();
        if empty {
            books.tenants.remove(&tenant);
        }
        books.bytes = books.bytes.saturating_sub(bytes);
    }

    /// The block to evict before `tenant` stores `bytes` more: None when the
    /// tier has room, holds one tenant's blocks only, or no tenant is above
    /// its share (the tier's own policy then decides).
    pub fn victim(&self, tenant: KvTenant, bytes: u64) -> Option<(u64, K)> {
        let books = self.books.lock();
        if books.bytes + bytes <= self.capacity_bytes {
            return None;
        }
        let tenants = books.tenants.len() as u64 + u64::from(!books.tenants.contains_key(&tenant));
        if tenants < 2 {
            return None;
        }
        let share = self.capacity_bytes / tenants;
        // The putter counts with what it puts, and wins a tie: a put never
        // takes from a tenant holding no more than the putter would.
        let own = books.tenants.get(&tenant).map_or(0, |held| held.bytes) + bytes;
        let largest_other = books.tenants.iter().filter(|(other, _)| **other != tenant).max_by_key(|(_, held)| held.bytes);
        let over = match largest_other {
            Some((_, other)) if other.bytes > own && other.bytes > share => other,
            _ if own > share => books.tenants.get(&tenant)?,
            _ => return None,
        };
        over.order.first_key_value().map(|(&stamp, &key)| (stamp, key))
    }

    /// Tenants holding blocks.
    pub fn tenants(&self) -> usize {
        self.books.lock().tenants.len()
    }

    /// Bytes `tenant` holds.
    pub fn bytes_of(&self, tenant: KvTenant) -> u64 {
        self.books.lock().tenants.get(&tenant).map_or(0, |held| held.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SequenceHash;

    fn key(n: u64) -> SequenceHash {
        SequenceHash(n)
    }

    #[test]
    fn room_comes_from_the_tenant_above_its_share() {
        let (a, b) = (KvTenant::of(&["a"]), KvTenant::of(&["b"]));
        let books = FairShare::new(100);
        for n in 0..9 {
            books.add(a, books.stamp(), key(n), 10);
        }
        assert_eq!(books.victim(a, 10), None, "room left");
        books.add(a, books.stamp(), key(9), 10);
        assert_eq!(books.victim(a, 10), None, "one tenant: the tier's own policy");
        // b is below its share (50): a, above, gives its oldest.
        assert_eq!(books.victim(b, 10), Some((1, key(0))));
        books.remove(a, 1, 10);
        books.add(b, books.stamp(), key(100), 10);
        // a puts again: above its share, it evicts its own.
        assert_eq!(books.victim(a, 10), Some((2, key(1))));
        books.remove(a, 2, 10);
        books.add(a, books.stamp(), key(10), 10);
        assert_eq!((books.bytes_of(a), books.bytes_of(b), books.tenants()), (90, 10, 2));
        // A stamp no longer counted changes nothing; the last block gone
        // takes its tenant along.
        books.remove(a, 2, 10);
        assert_eq!(books.bytes_of(a), 90);
        books.remove(b, 11, 10);
        assert_eq!((books.bytes_of(b), books.tenants()), (0, 1));
    }

    #[test]
    fn a_tenant_at_its_share_pays_for_its_own_put() {
        let books = FairShare::new(90);
        for (n, name) in ["a", "b", "c"].iter().enumerate() {
            for m in 0..3 {
                books.add(KvTenant::of(&[name]), books.stamp(), key(n as u64 * 10 + m), 10);
            }
        }
        assert_eq!(books.victim(KvTenant::of(&["a"]), 10), Some((1, key(0))), "90 of 90 held, each tenant 30 of its 30: a's own oldest");
        let newcomer = books.victim(KvTenant::of(&["d"]), 10);
        assert!(
            [Some((1, key(0))), Some((4, key(10))), Some((7, key(20)))].contains(&newcomer),
            "a newcomer's room comes from one of the largest, oldest first: {newcomer:?}"
        );
        books.add(KvTenant::of(&["a"]), books.stamp(), key(3), 10);
        assert_eq!(books.victim(KvTenant::of(&["b"]), 10), Some((4, key(10))), "b with its put as large as a: its own first");
        books.add(KvTenant::of(&["a"]), books.stamp(), key(4), 10);
        assert_eq!(books.victim(KvTenant::of(&["b"]), 10), Some((1, key(0))), "a is above b with its put now");
    }
}
