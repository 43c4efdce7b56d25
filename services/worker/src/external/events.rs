//! An external engine's own KV events, as Turbine's: vLLM publishes what
//! its prefix cache stores and evicts over ZMQ (msgpack batches of
//! `BlockStored`, `BlockRemoved`, `AllBlocksCleared`, named by its own
//! block hashes); [`KvMirror`] recomputes Turbine's hashes of each block
//! from the token ids the events carry (the engine's block size, the
//! request's KV namespace recovered from the salt the adapter sent), so
//! the router, kv-index and event log work unchanged. It numbers the
//! events it emits per worker from 0 and dumps what it mirrors, so a
//! follower resynchronises as from a native worker.
//!
//! What cannot be mapped is left out, never guessed: a block whose parent
//! the mirror does not know (stored before the worker listened), a chain
//! under a salt or LoRA the adapter did not send. Its prefix is then not
//! credited (the router's approximate view), which costs a cache hit at
//! worst. A new connection from the engine (a restart, a reconnect after
//! dropped messages) or a gap in its sequence numbers asks the engine's
//! replay socket, when it has one, for the batches missed since the last
//! one applied; what that cannot fill clears the mirror (an
//! `AllBlocksCleared` for followers): what the engine still caches is
//! credited again as it is stored anew.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::broadcast;
use turbine_kv::{BlockHasher, CacheSalt, CachedBlock, Dump, KvEvent, LocalBlockHash, NumberedEvent, SequenceHash, StoredBlock, Tier, TierSet};
use turbine_runtime::CancellationToken;

use super::msgpack::{self, Value};
use super::zmtp::{Dealer, Subscriber, ZmtpError};
use crate::metrics;

/// Events a lagging follower may fall behind by before it resynchronises.
const EVENT_BUFFER: usize = 4096;

/// A block as the engine names it: vLLM's hashes are integers by default,
/// 32 bytes with `sha256_cbor` and integer hashes off.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EngineHash {
    Int(i128),
    Bytes(Vec<u8>),
}

impl EngineHash {
    fn from_value(value: &Value) -> Option<Self> {
        match value {
            Value::Int(i) => Some(Self::Int(*i)),
            Value::Bin(bytes) => Some(Self::Bytes(bytes.clone())),
            _ => None,
        }
    }
}

/// One of the engine's events, as far as Turbine reads it.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// Consecutive blocks of one chain stored.
    Stored {
        hashes: Vec<EngineHash>,
        parent: Option<EngineHash>,
        /// Every stored block's tokens, flat.
        token_ids: Vec<u32>,
        block_size: usize,
        tier: Tier,
        /// The first block's extra hash keys (LoRA name, multimodal ids,
        /// the request's cache salt), as the engine published them.
        first_extra_keys: Vec<Value>,
        /// Stored for a LoRA adapter (Turbine serves none).
        lora: bool,
    },
    /// Blocks evicted from a tier.
    Removed { hashes: Vec<EngineHash>, tier: Tier },
    /// The whole cache emptied.
    Cleared,
}

/// Where vLLM says a block is (`medium`).
fn tier(medium: Option<&Value>) -> Tier {
    match medium.and_then(Value::as_str) {
        Some("CPU") => Tier::Host,
        Some("STORAGE") => Tier::Disk,
        _ => Tier::Device,
    }
}

fn hashes(value: Option<&Value>) -> Result<Vec<EngineHash>, String> {
    let items = value.and_then(Value::as_array).ok_or("an event without block_hashes")?;
    items.iter().map(|item| EngineHash::from_value(item).ok_or_else(|| format!("a block hash that is neither an integer nor bytes: {item:?}"))).collect()
}

/// The events of one published batch (`[ts, events, data_parallel_rank]`);
/// events of kinds Turbine does not read are skipped.
pub fn decode_batch(payload: &[u8]) -> Result<Vec<EngineEvent>, String> {
    let batch = msgpack::decode(payload).map_err(|error| error.to_string())?;
    let fields = batch.as_array().ok_or("a batch that is not an array")?;
    let events = fields.get(1).and_then(Value::as_array).ok_or("a batch without events")?;
    let mut decoded = Vec::with_capacity(events.len());
    for event in events {
        match event.get("type").and_then(Value::as_str) {
            Some("BlockStored") => {
                // Hybrid models' other cache groups (sliding windows,
                // state) are not prefix caches Turbine routes on.
                if event.get("group_idx").and_then(Value::as_int).is_some_and(|group| group != 0) {
                    continue;
                }
                let token_ids = event.get("token_ids").and_then(Value::as_array).ok_or("BlockStored without token_ids")?;
                let token_ids = token_ids
                    .iter()
                    .map(|id| id.as_int().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| format!("a token id {id:?}")))
                    .collect::<Result<Vec<u32>, String>>()?;
                let block_size =
                    event.get("block_size").and_then(Value::as_int).and_then(|size| usize::try_from(size).ok()).ok_or("BlockStored without block_size")?;
                let parent = match event.get("parent_block_hash") {
                    None | Some(Value::Nil) => None,
                    Some(parent) => Some(EngineHash::from_value(parent).ok_or("a parent hash that is neither an integer nor bytes")?),
                };
                let first_extra_keys = match event.get("extra_keys").and_then(Value::as_array).and_then(|keys| keys.first()) {
                    Some(Value::Array(keys)) => keys.clone(),
                    _ => Vec::new(),
                };
                let lora = event.get("lora_name").is_some_and(|name| !name.is_nil()) || event.get("lora_id").is_some_and(|id| !id.is_nil());
                decoded.push(EngineEvent::Stored {
                    hashes: hashes(event.get("block_hashes"))?,
                    parent,
                    token_ids,
                    block_size,
                    tier: tier(event.get("medium")),
                    first_extra_keys,
                    lora,
                });
            }
            Some("BlockRemoved") => {
                if event.get("group_idx").and_then(Value::as_int).is_some_and(|group| group != 0) {
                    continue;
                }
                decoded.push(EngineEvent::Removed { hashes: hashes(event.get("block_hashes"))?, tier: tier(event.get("medium")) });
            }
            Some("AllBlocksCleared") => decoded.push(EngineEvent::Cleared),
            _ => {}
        }
    }
    Ok(decoded)
}

/// The cache salt the adapter sends for `salt` (vLLM's `cache_salt`).
pub fn salt_text(salt: CacheSalt) -> Option<String> {
    (!salt.is_shared()).then(|| format!("turbine-{:016x}", salt.get()))
}

/// The KV namespace a chain's first block was stored under: the shared one
/// without extra keys, the adapter's salt when it is the only key, `None`
/// (not Turbine's to credit) for anything else.
fn namespace(first_extra_keys: &[Value]) -> Option<CacheSalt> {
    match first_extra_keys {
        [] => Some(CacheSalt::SHARED),
        [Value::Str(text)] => text.strip_prefix("turbine-").and_then(|hex| u64::from_str_radix(hex, 16).ok()).map(CacheSalt::new),
        _ => None,
    }
}

#[derive(Debug, Clone, Copy)]
struct Mirrored {
    sequence: SequenceHash,
    local: LocalBlockHash,
    salt: CacheSalt,
    tiers: TierSet,
}

/// What the engine caches, in Turbine's hashes, and the events that said so.
#[derive(Debug)]
pub struct KvMirror {
    worker: String,
    block_size: usize,
    hash_seed: u64,
    blocks: HashMap<EngineHash, Mirrored>,
    next_event_id: u64,
    events: broadcast::Sender<NumberedEvent>,
    /// The engine's last batch applied: its number and a digest of its
    /// bytes, so that a replay is known to continue this engine's events
    /// (a restarted engine numbers from 0 again).
    last: Option<(u64, u64)>,
}

impl KvMirror {
    /// An empty mirror of an engine caching blocks of `block_size` tokens.
    pub fn new(worker: &str, block_size: usize) -> Self {
        Self {
            worker: worker.to_owned(),
            block_size,
            hash_seed: turbine_kv::DEFAULT_SEED,
            blocks: HashMap::new(),
            next_event_id: 0,
            events: broadcast::channel(EVENT_BUFFER).0,
            last: None,
        }
    }

    /// The number the engine's next batch should carry, once one was
    /// applied.
    fn expected(&self) -> Option<u64> {
        self.last.map(|(sequence, _)| sequence.wrapping_add(1))
    }

    /// Applies the engine's batch numbered `sequence` (its msgpack bytes).
    fn apply_batch(&mut self, sequence: u64, payload: &[u8]) {
        match decode_batch(payload) {
            Ok(events) => events.into_iter().for_each(|event| self.apply(event)),
            Err(error) => {
                tracing::warn!(worker = %self.worker, %error, "unreadable KV events: the mirror is cleared");
                self.clear("unreadable events");
            }
        }
        self.last = Some((sequence, digest(payload)));
    }

    /// Applies the batches an engine replayed from the last one applied:
    /// only when they continue it (the first is that very batch, the rest
    /// follow without a hole), so nothing is applied twice or out of
    /// order, and a restarted engine's numbers are not taken for this one's.
    fn resume(&mut self, replayed: &[(u64, Vec<u8>)]) -> bool {
        let Some(last) = self.last else { return false };
        let Some(((first, payload), rest)) = replayed.split_first() else { return false };
        if (*first, digest(payload)) != last || rest.iter().zip(first + 1..).any(|((sequence, _), expected)| *sequence != expected) {
            return false;
        }
        for (sequence, payload) in rest {
            self.apply_batch(*sequence, payload);
        }
        true
    }

    /// Forgets everything and the engine's numbering with it.
    fn start_over(&mut self, why: &str) {
        self.clear(why);
        self.last = None;
    }

    /// The events from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<NumberedEvent> {
        self.events.subscribe()
    }

    /// Every block mirrored, as of the next event's number.
    pub fn dump(&self) -> Dump {
        let blocks = self.blocks.values().map(|block| CachedBlock { sequence_hash: block.sequence, local_hash: block.local, tiers: block.tiers }).collect();
        Dump { next_event_id: self.next_event_id, blocks }
    }

    fn emit(&mut self, event: KvEvent) {
        let event_id = self.next_event_id;
        self.next_event_id += 1;
        let _ = self.events.send(NumberedEvent { event_id, event });
    }

    /// Forgets everything (the engine restarted, reconnected or events were
    /// lost): followers are told the cache was cleared.
    pub fn clear(&mut self, why: &str) {
        if !self.blocks.is_empty() {
            tracing::info!(worker = %self.worker, blocks = self.blocks.len(), why, "the engine's KV events start over: the mirror is cleared");
            self.blocks.clear();
            self.emit(KvEvent::Cleared);
        }
    }

    /// Applies one of the engine's events.
    pub fn apply(&mut self, event: EngineEvent) {
        match event {
            EngineEvent::Stored { hashes, parent, token_ids, block_size, tier, first_extra_keys, lora } => {
                let start = match &parent {
                    None if lora => None,
                    None => namespace(&first_extra_keys).map(|salt| (None, salt)),
                    Some(parent) => self.blocks.get(parent).map(|parent| (Some(parent.sequence), parent.salt)),
                };
                let Some((parent_sequence, salt)) = start.filter(|_| block_size == self.block_size && !lora) else {
                    metrics::upstream_kv_blocks_unmapped(&self.worker, hashes.len());
                    return;
                };
                let hasher = BlockHasher::salted(self.hash_seed, salt);
                let mut chain = parent_sequence;
                let mut stored = Vec::with_capacity(hashes.len());
                for (hash, tokens) in hashes.into_iter().zip(token_ids.chunks_exact(block_size)) {
                    let local = hasher.local(tokens);
                    let sequence = hasher.chain(chain, local);
                    chain = Some(sequence);
                    let block = self.blocks.entry(hash).or_insert(Mirrored { sequence, local, salt, tiers: TierSet::default() });
                    block.tiers.insert(tier);
                    stored.push(StoredBlock { sequence_hash: sequence, local_hash: local });
                }
                if !stored.is_empty() {
                    self.emit(KvEvent::Stored { parent: parent_sequence, blocks: stored, tier });
                }
            }
            EngineEvent::Removed { hashes, tier } => {
                let mut removed = Vec::new();
                for hash in hashes {
                    let Some(block) = self.blocks.get_mut(&hash) else { continue };
                    block.tiers.remove(tier);
                    removed.push(block.sequence);
                    if block.tiers.is_empty() {
                        self.blocks.remove(&hash);
                    }
                }
                if !removed.is_empty() {
                    self.emit(KvEvent::Removed { sequence_hashes: removed, tier });
                }
            }
            EngineEvent::Cleared => {
                self.blocks.clear();
                self.emit(KvEvent::Cleared);
            }
        }
    }
}

/// Receives the engine's events on `listener` until `shutdown`: each
/// connection (the engine's PUB socket connects) is subscribed to every
/// topic and followed. A new connection, or a gap in the numbering, asks
/// the engine's `replay` socket (when it has one) for the batches missed
/// since the last one applied; what cannot be filled so clears the mirror.
pub async fn receive(listener: TcpListener, mirror: Arc<Mutex<KvMirror>>, replay: Option<SocketAddr>, shutdown: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::warn!(%error, "accepting the engine's KV event connection failed");
                continue;
            }
        };
        let (mirror, shutdown) = (mirror.clone(), shutdown.clone());
        tokio::spawn(async move {
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = follow(stream, peer, mirror, replay) => {}
            }
        });
    }
}

/// The longest a replay may take, connecting included.
const REPLAY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// The most bytes of batches one replay may bring (vLLM keeps 10,000
/// batches by default, a few KiB each).
const REPLAY_MAX_BYTES: usize = 256 << 20;

/// Fills the mirror from the engine's replay socket at `replay` with what
/// followed its last batch; whether it could.
async fn fill(mirror: &Mutex<KvMirror>, replay: Option<SocketAddr>) -> bool {
    let (Some(replay), Some((last, _))) = (replay, mirror.lock().last) else { return false };
    let worker = mirror.lock().worker.clone();
    let resumed = match tokio::time::timeout(REPLAY_TIMEOUT, fetch(replay, last)).await {
        Ok(Ok(replayed)) => {
            let resumed = mirror.lock().resume(&replayed);
            if resumed {
                tracing::info!(%worker, from = last, batches = replayed.len().saturating_sub(1), "the engine replayed the KV events missed");
            } else {
                tracing::info!(%worker, from = last, "the engine's replay does not continue the events applied (it restarted, or its buffer moved on)");
            }
            resumed
        }
        Ok(Err(error)) => {
            tracing::warn!(%worker, %replay, %error, "asking the engine to replay its KV events failed");
            false
        }
        Err(_) => {
            tracing::warn!(%worker, %replay, "the engine's KV event replay took over {} s", REPLAY_TIMEOUT.as_secs());
            false
        }
    };
    metrics::upstream_kv_event_replay(&worker, if resumed { "filled" } else { "failed" });
    resumed
}

/// The batches the engine at `replay` still holds from number `from` on:
/// vLLM's replay socket (a ROUTER) answers a request of the starting
/// number with `[_, topic, number, batch]` messages, then
/// `[_, _, -1, _]`.
async fn fetch(replay: SocketAddr, from: u64) -> Result<Vec<(u64, Vec<u8>)>, ZmtpError> {
    let mut dealer = Dealer::handshake(tokio::net::TcpStream::connect(replay).await?).await?;
    dealer.send(&[b"", &from.to_be_bytes()]).await?;
    let (mut replayed, mut bytes) = (Vec::new(), 0usize);
    loop {
        let Some(message) = dealer.recv().await? else {
            return Err(ZmtpError::Protocol("the replay socket closed before the end of its replay".into()));
        };
        let [_, _topic, sequence, payload] = message.as_slice() else {
            return Err(ZmtpError::Protocol(format!("a replayed message of {} frames (4 expected)", message.len())));
        };
        let sequence = <[u8; 8]>::try_from(sequence.as_slice())
            .map(u64::from_be_bytes)
            .map_err(|_| ZmtpError::Protocol("a replayed message without an 8-byte number".into()))?;
        if sequence == u64::MAX {
            return Ok(replayed);
        }
        bytes += payload.len();
        if bytes > REPLAY_MAX_BYTES {
            return Err(ZmtpError::Protocol(format!("a replay of over {} MiB", REPLAY_MAX_BYTES >> 20)));
        }
        replayed.push((sequence, payload.clone()));
    }
}

async fn follow(stream: tokio::net::TcpStream, peer: SocketAddr, mirror: Arc<Mutex<KvMirror>>, replay: Option<SocketAddr>) {
    let handshake = tokio::time::timeout(std::time::Duration::from_secs(5), Subscriber::handshake(stream, b"")).await;
    let mut subscriber = match handshake {
        Ok(Ok(subscriber)) => subscriber,
        Ok(Err(error)) => return tracing::warn!(%peer, %error, "refused a KV event connection"),
        Err(_) => return tracing::warn!(%peer, "refused a KV event connection: no handshake within 5 s"),
    };
    let worker = mirror.lock().worker.clone();
    tracing::info!(%worker, %peer, "the engine's KV events connected");
    // Subscribed first, so what the engine publishes from now on arrives
    // here; what it published since the last batch applied comes from
    // its replay.
    if !fill(&mirror, replay).await {
        mirror.lock().start_over("a new connection from the engine");
    }
    loop {
        let message = match subscriber.recv().await {
            Ok(Some(message)) => message,
            Ok(None) => return tracing::info!(%worker, %peer, "the engine's KV events disconnected"),
            Err(error) => return tracing::warn!(%worker, %peer, %error, "the engine's KV event stream broke"),
        };
        // [topic, sequence number (8 bytes, big-endian), payload]
        let [_topic, sequence, payload] = message.as_slice() else {
            tracing::warn!(%worker, parts = message.len(), "a KV event message of an unknown shape: skipped");
            continue;
        };
        let Ok(sequence) = <[u8; 8]>::try_from(sequence.as_slice()).map(u64::from_be_bytes) else {
            tracing::warn!(%worker, "a KV event message without an 8-byte sequence number: skipped");
            continue;
        };
        let expected = mirror.lock().expected();
        if let Some(expected) = expected
            && sequence > expected
            && !fill(&mirror, replay).await
        {
            metrics::upstream_kv_event_gap(&worker);
            mirror.lock().start_over(&format!("events {expected} to {} were lost", sequence - 1));
        }
        let mut mirror = mirror.lock();
        match mirror.expected() {
            // Applied already, from the replay.
            Some(expected) if sequence < expected => continue,
            Some(expected) if sequence > expected => {
                metrics::upstream_kv_event_gap(&worker);
                mirror.start_over(&format!("events {expected} to {} were not replayed", sequence - 1));
            }
            _ => {}
        }
        mirror.apply_batch(sequence, payload);
    }
}

/// A digest of a batch's bytes, to tell one batch from another.
fn digest(payload: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    payload.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests;
