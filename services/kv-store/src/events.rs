//! What the store holds, as KV events: every block that enters or leaves
//! the store is announced in the vocabulary of the KV event log (`Stored`
//! and `Removed`, tier remote), so that routers can credit a prefix any
//! worker could fetch from the store.
//!
//! The index knows a store by one name per layout fingerprint
//! ([`WorkerId::of_store`]): blocks of different models never mix there
//! either. Each fingerprint's events are numbered from 0 in this
//! incarnation of the store (a random [`Announcer::instance`]); a consumer
//! that sees a gap loads a [`Announcer::dump`], which is consistent with
//! that numbering.
//!
//! The store's lowest tier announces: with a disk tier, a block is in the
//! store while its file is (every put is written through); without one,
//! while it is in memory. A block whose disk write failed is held in
//! memory but never announced: a router may miss a hit, never credit one
//! that is not there for long.

use std::sync::Arc;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use tokio::sync::broadcast;
use tokio::sync::broadcast::error::RecvError;
use tokio::task::JoinHandle;
use turbine_kv::index::Applied;
use turbine_kv::{CachedBlock, Dump, EventBatch, KvEvent, KvIndex, LocalBlockHash, NumberedEvent, SequenceHash, StoredBlock, Tier, TierSet, WorkerId};
use turbine_kv_log::EventLog;

use turbine_runtime::CancellationToken;

use crate::keys::Fingerprint;

/// Announcements buffered per subscriber; a subscriber that falls further
/// behind misses some and its consumers load a dump.
const BUFFERED: usize = 8192;

/// One announced change of one fingerprint's blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announced {
    /// Whose blocks changed.
    pub fingerprint: Fingerprint,
    /// The change, numbered within the fingerprint.
    pub event: NumberedEvent,
}

/// One fingerprint's blocks as announced so far.
#[derive(Debug, Default)]
struct View {
    next_event_id: u64,
    blocks: FxHashMap<SequenceHash, LocalBlockHash>,
}

/// Numbers and broadcasts the store's changes, and keeps the view they
/// add up to. Cloning shares it.
#[derive(Debug, Clone)]
pub struct Announcer {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    instance: u64,
    /// Kept for every fingerprint ever announced, emptied or not: its
    /// numbering must never restart within one incarnation.
    views: Mutex<FxHashMap<Fingerprint, View>>,
    events: broadcast::Sender<Announced>,
}

impl Default for Announcer {
    fn default() -> Self {
        Self::new()
    }
}

impl Announcer {
    /// An announcer of a new incarnation: nothing announced yet.
    pub fn new() -> Self {
        let instance = uuid::Uuid::new_v4().as_u64_pair().0;
        Self { inner: Arc::new(Inner { instance, views: Mutex::default(), events: broadcast::channel(BUFFERED).0 }) }
    }

    /// This incarnation (random per start): numbering restarts with it.
    pub fn instance(&self) -> u64 {
        self.inner.instance
    }

    /// Every change from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Announced> {
        self.inner.events.subscribe()
    }

    /// A block entered the store (nothing is announced if it was in
    /// already).
    pub(crate) fn stored(&self, fingerprint: Fingerprint, sequence_hash: SequenceHash, local_hash: LocalBlockHash, parent: Option<SequenceHash>) {
        let mut views = self.inner.views.lock();
        let view = views.entry(fingerprint).or_default();
        if view.blocks.insert(sequence_hash, local_hash).is_some() {
            return;
        }
        let event = KvEvent::Stored { parent, blocks: vec![StoredBlock { sequence_hash, local_hash }], tier: Tier::Remote };
        self.send(fingerprint, view, event);
    }

    /// Announces, for every fingerprint known, that the store is here: an
    /// empty `Stored`. A consumer that did not see this incarnation's
    /// earlier events finds the gap before it and loads a dump; for one
    /// that did, it changes nothing.
    pub fn announce_presence(&self) {
        let mut views = self.inner.views.lock();
        for (&fingerprint, view) in views.iter_mut() {
            if view.next_event_id > 0 {
                self.send(fingerprint, view, KvEvent::Stored { parent: None, blocks: Vec::new(), tier: Tier::Remote });
            }
        }
    }

    /// A block left the store (nothing is announced if it was not in).
    pub(crate) fn removed(&self, fingerprint: Fingerprint, sequence_hash: SequenceHash) {
        let mut views = self.inner.views.lock();
        let Some(view) = views.get_mut(&fingerprint) else { return };
        if view.blocks.remove(&sequence_hash).is_none() {
            return;
        }
        self.send(fingerprint, view, KvEvent::Removed { sequence_hashes: vec![sequence_hash], tier: Tier::Remote });
    }

    /// Numbers `event` in `view` and broadcasts it, under the views' lock
    /// (so subscribers receive each fingerprint's events in order).
    fn send(&self, fingerprint: Fingerprint, view: &mut View, event: KvEvent) {
        let event = NumberedEvent { event_id: view.next_event_id, event };
        view.next_event_id += 1;
        // No subscriber: nobody publishes; a dump still tells.
        let _ = self.inner.events.send(Announced { fingerprint, event });
    }

    /// Every block of `fingerprint` announced and not removed, as of the
    /// returned dump's event number.
    pub fn dump(&self, fingerprint: Fingerprint) -> Dump {
        let views = self.inner.views.lock();
        let Some(view) = views.get(&fingerprint) else { return Dump::default() };
        let tiers = TierSet(Tier::Remote.bit());
        let blocks = view.blocks.iter().map(|(&sequence_hash, &local_hash)| CachedBlock { sequence_hash, local_hash, tiers }).collect();
        Dump { next_event_id: view.next_event_id, blocks }
    }

    /// Blocks announced and not removed, per fingerprint.
    pub fn held(&self) -> Vec<(Fingerprint, usize)> {
        let mut held: Vec<_> = self.inner.views.lock().iter().map(|(&fingerprint, view)| (fingerprint, view.blocks.len())).collect();
        held.sort_unstable();
        held
    }
}

/// Where the store's announcements go.
#[derive(Debug, Clone, Default)]
#[allow(clippy::large_enum_variant, reason = "one value per process, built at startup")]
pub enum StoreEventSink {
    /// Nowhere: no router credits the store's blocks.
    #[default]
    None,
    /// The KV event log (Redis), for every router and kv-index.
    Log(EventLog),
    /// An index in this process (`turbine run`).
    Index(Arc<KvIndex>),
}

/// Sends `announcer`'s changes, named as store `store_id`'s, to `sink`
/// until `shutdown`.
pub fn announce(announcer: Announcer, store_id: &str, sink: StoreEventSink, shutdown: CancellationToken) -> Option<JoinHandle<()>> {
    let store_id = store_id.to_owned();
    match sink {
        StoreEventSink::None => None,
        StoreEventSink::Log(log) => Some(tokio::spawn(publish(announcer, store_id, log, shutdown))),
        StoreEventSink::Index(index) => Some(tokio::spawn(feed(announcer, store_id, index, shutdown))),
    }
}

async fn publish(announcer: Announcer, store_id: String, log: EventLog, shutdown: CancellationToken) {
    let events = announcer.subscribe();
    announcer.announce_presence();
    let mut names = Names::new(store_id);
    let instance = announcer.instance();
    // One batch per fingerprint, each in order.
    turbine_kv_log::publish_all(events, log, shutdown, "kv-store events", |received| {
        let mut batches: Vec<EventBatch> = Vec::new();
        for Announced { fingerprint, event } in received {
            let worker_id = names.of(fingerprint);
            match batches.iter_mut().find(|batch| batch.worker_id == worker_id) {
                Some(batch) => batch.events.push(event),
                None => batches.push(EventBatch { worker_id, instance, events: vec![event] }),
            }
        }
        batches
    })
    .await;
}

async fn feed(announcer: Announcer, store_id: String, index: Arc<KvIndex>, shutdown: CancellationToken) {
    let mut events = announcer.subscribe();
    let mut names = Names::new(store_id);
    let instance = announcer.instance();
    let load = |names: &mut Names, fingerprint: Fingerprint| index.load_dump(&names.of(fingerprint), instance, &announcer.dump(fingerprint));
    for (fingerprint, _) in announcer.held() {
        load(&mut names, fingerprint);
    }
    loop {
        let next = tokio::select! {
            () = shutdown.cancelled() => break,
            next = events.recv() => next,
        };
        match next {
            Ok(Announced { fingerprint, event }) => {
                if let Applied::Gap { .. } = index.apply(&names.of(fingerprint), instance, &event) {
                    load(&mut names, fingerprint);
                }
            }
            Err(RecvError::Lagged(_)) => {
                for (fingerprint, _) in announcer.held() {
                    load(&mut names, fingerprint);
                }
            }
            Err(RecvError::Closed) => break,
        }
    }
    for (fingerprint, _) in announcer.held() {
        index.remove_worker(&names.of(fingerprint));
    }
}

/// Each fingerprint's name in the index, made once.
struct Names {
    store_id: String,
    names: FxHashMap<Fingerprint, WorkerId>,
}

impl Names {
    fn new(store_id: String) -> Self {
        Self { store_id, names: FxHashMap::default() }
    }

    fn of(&mut self, fingerprint: Fingerprint) -> WorkerId {
        self.names.entry(fingerprint).or_insert_with(|| WorkerId::of_store(&self.store_id, fingerprint.get())).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(n: u64) -> Fingerprint {
        Fingerprint::new(n).unwrap()
    }

    #[test]
    fn changes_are_numbered_per_fingerprint_and_a_dump_matches_them() {
        let announcer = Announcer::new();
        let mut events = announcer.subscribe();
        announcer.stored(fp(1), SequenceHash(10), LocalBlockHash(1), None);
        announcer.stored(fp(1), SequenceHash(10), LocalBlockHash(1), None);
        announcer.stored(fp(2), SequenceHash(10), LocalBlockHash(1), None);
        announcer.stored(fp(1), SequenceHash(11), LocalBlockHash(2), Some(SequenceHash(10)));
        announcer.removed(fp(1), SequenceHash(10));
        announcer.removed(fp(1), SequenceHash(99));
        let mut got = Vec::new();
        while let Ok(announced) = events.try_recv() {
            got.push((announced.fingerprint.get(), announced.event.event_id, matches!(announced.event.event, KvEvent::Stored { .. })));
        }
        assert_eq!(got, [(1, 0, true), (2, 0, true), (1, 1, true), (1, 2, false)], "repeats and unknown removals announce nothing");
        let dump = announcer.dump(fp(1));
        assert_eq!(dump.next_event_id, 3);
        assert_eq!(dump.blocks, [CachedBlock { sequence_hash: SequenceHash(11), local_hash: LocalBlockHash(2), tiers: TierSet(Tier::Remote.bit()) }]);
        announcer.removed(fp(1), SequenceHash(11));
        announcer.stored(fp(1), SequenceHash(12), LocalBlockHash(3), None);
        assert_eq!(announcer.dump(fp(1)).next_event_id, 5, "an emptied fingerprint keeps counting");
        assert_eq!(announcer.dump(fp(3)), Dump::default());
        assert_ne!(announcer.instance(), Announcer::new().instance());
    }

    #[tokio::test]
    async fn an_index_in_process_follows_the_store() {
        let announcer = Announcer::new();
        announcer.stored(fp(1), SequenceHash(10), LocalBlockHash(1), None);
        let (index, shutdown) = (Arc::new(KvIndex::new()), CancellationToken::new());
        let task = announce(announcer.clone(), "s", StoreEventSink::Index(index.clone()), shutdown.clone()).unwrap();
        let name = WorkerId::of_store("s", 1);
        let matched = |hashes: &[u64]| {
            let hashes: Vec<SequenceHash> = hashes.iter().map(|&h| SequenceHash(h)).collect();
            index.find_matches(&hashes).of(&name).map(|m| m.by_tier)
        };
        // What was held before the feed started comes from a dump.
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while matched(&[10]).is_none() {
            assert!(tokio::time::Instant::now() < deadline, "the dump never reached the index");
            tokio::task::yield_now().await;
        }
        announcer.stored(fp(1), SequenceHash(11), LocalBlockHash(2), Some(SequenceHash(10)));
        while matched(&[10, 11]) != Some([0, 0, 0, 2]) {
            assert!(tokio::time::Instant::now() < deadline, "a change never reached the index: {:?}", matched(&[10, 11]));
            tokio::task::yield_now().await;
        }
        shutdown.cancel();
        task.await.unwrap();
        assert!(!index.has_worker(&name), "a store that stops leaves the index");
    }
}
