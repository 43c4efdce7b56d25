//! [`KvStoreTier`]: the kv-store as an engine's shared tier (G4), the
//! [`RemoteStore`] a worker gives its engine: blocks the host tier stores
//! are put to the store by a task of their own, and a waiting request's
//! prefix is fetched from it on the engine's reader thread: over UCX when
//! this build and the store have it (the blocks are leased and copied out
//! of the store's memory), else, or when that fails, over the gRPC stream.
//!
//! Nothing here can fail a request: a put that fails is logged and counted
//! (the block is simply not shared); a get that fails, times out or returns
//! a block that does not match is a miss, and the engine computes the rest.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use tokio::sync::mpsc;

#[cfg(feature = "ucx")]
use turbine_api::kv_store::KvStoreError;
use turbine_api::kv_store::{Fingerprint, KvStoreClient};
use turbine_engine::{HostBlock, RemoteGetError, RemoteStore};
use turbine_kv::{BlockHashes, SequenceHash};

/// Runs of blocks queued for the store at most; more are dropped (not
/// shared) rather than held.
const PUT_QUEUE: usize = 64;

/// Blocks remembered as held by the store (put or fetched), so that a
/// block onboarded from it is not put back.
const KNOWN_BLOCKS: u64 = 1 << 20;

/// The kv-store as the engine's [`RemoteStore`].
pub struct KvStoreTier {
    client: KvStoreClient,
    fingerprint: Fingerprint,
    runtime: tokio::runtime::Handle,
    puts: mpsc::Sender<Vec<(SequenceHash, Arc<HostBlock>)>>,
    known: moka::sync::Cache<SequenceHash, ()>,
    get_timeout: Duration,
    failed_puts: Arc<AtomicU64>,
    get_failed: AtomicBool,
    #[cfg(feature = "ucx")]
    ucx: Arc<UcxSide>,
}

/// Staging memory of a worker's UCX link to the store (puts of more wait
/// for the previous `PutFrom`).
#[cfg(feature = "ucx")]
const STAGING_BYTES: usize = 64 << 20;

/// The tier's UCX link, shared by the reader thread and the put task.
#[cfg(feature = "ucx")]
struct UcxSide {
    /// Started at first use; None inside: UCX cannot start here.
    link: std::sync::OnceLock<Option<turbine_ucx_agent::KvStoreLink>>,
    /// The devices the link may use.
    network: turbine_kv::UcxNetwork,
    /// The store has no UCX data path (or the caller turned UCX off).
    no_data_path: AtomicBool,
}

#[cfg(feature = "ucx")]
impl UcxSide {
    /// The link, unless UCX is off or cannot start.
    fn link(&self) -> Option<&turbine_ucx_agent::KvStoreLink> {
        if self.no_data_path.load(Relaxed) {
            return None;
        }
        self.link
            .get_or_init(|| {
                turbine_ucx_agent::KvStoreLink::with_staging(STAGING_BYTES, &self.network)
                    .inspect_err(|error| tracing::warn!(%error, "cannot start UCX; KV blocks go to and from the kv-store over gRPC"))
                    .ok()
            })
            .as_ref()
    }

    /// Whether a failed call says the store has no UCX data path (and
    /// remembers it).
    fn refused(&self, error: &KvStoreError) -> bool {
        let refused = matches!(error, KvStoreError::NotServed(_));
        if refused && !self.no_data_path.swap(true, Relaxed) {
            tracing::info!("the kv-store has no UCX data path; KV blocks go to and from it over gRPC");
        }
        refused
    }

    /// Puts `run` over UCX; None when UCX is not used (put over gRPC).
    async fn put(&self, client: &KvStoreClient, fingerprint: Fingerprint, run: &[(SequenceHash, Arc<HostBlock>)]) -> Option<()> {
        match self.link()?.put(client, fingerprint, run).await {
            Ok(_) => Some(()),
            Err(error) => {
                if !self.refused(&error) {
                    tracing::debug!(%error, "a UCX put to the kv-store failed; putting over gRPC");
                }
                None
            }
        }
    }
}

impl KvStoreTier {
    /// The store behind `client`, for blocks of layout `fingerprint`; a get
    /// that takes longer than `get_timeout` is a miss; UCX (when built)
    /// on the devices `network` allows. Must be called within a Tokio
    /// runtime (the put task runs on it).
    pub fn new(client: KvStoreClient, fingerprint: Fingerprint, get_timeout: Duration, network: turbine_kv::UcxNetwork) -> Self {
        let (puts, mut queued) = mpsc::channel::<Vec<(SequenceHash, Arc<HostBlock>)>>(PUT_QUEUE);
        let known = moka::sync::Cache::new(KNOWN_BLOCKS);
        let failed_puts = Arc::new(AtomicU64::new(0));
        #[cfg(feature = "ucx")]
        let ucx = Arc::new(UcxSide { link: std::sync::OnceLock::new(), network, no_data_path: AtomicBool::new(false) });
        #[cfg(not(feature = "ucx"))]
        let _ = network;
        {
            let (client, known, failures) = (client.clone(), known.clone(), failed_puts.clone());
            #[cfg(feature = "ucx")]
            let ucx = ucx.clone();
            tokio::spawn(async move {
                while let Some(run) = queued.recv().await {
                    #[cfg(feature = "ucx")]
                    if ucx.put(&client, fingerprint, &run).await.is_some() {
                        run.iter().for_each(|(hash, _)| known.insert(*hash, ()));
                        continue;
                    }
                    match client.put(fingerprint, &run).await {
                        Ok(_) => run.iter().for_each(|(hash, _)| known.insert(*hash, ())),
                        Err(error) => {
                            if failures.fetch_add(1, Relaxed) == 0 {
                                tracing::warn!(%error, "cannot put KV blocks to the kv-store; they are not shared (logged once)");
                            }
                        }
                    }
                }
            });
        }
        Self {
            client,
            fingerprint,
            runtime: tokio::runtime::Handle::current(),
            puts,
            known,
            get_timeout,
            failed_puts,
            get_failed: AtomicBool::new(false),
            #[cfg(feature = "ucx")]
            ucx,
        }
    }

    /// Reads over the gRPC stream only, even where UCX could be used (a
    /// benchmark's baseline).
    pub fn without_ucx(self) -> Self {
        #[cfg(feature = "ucx")]
        self.ucx.no_data_path.store(true, Relaxed);
        self
    }

    /// The run read over UCX; None when this reader or the store has no
    /// UCX data path, or the read failed (the caller uses the gRPC stream).
    #[cfg(feature = "ucx")]
    async fn get_over_ucx(&self, sequence: &[SequenceHash]) -> Option<Vec<(SequenceHash, HostBlock)>> {
        let link = self.ucx.link()?;
        match link.get(&self.client, self.fingerprint, sequence, self.get_timeout).await {
            Ok(run) => Some(run),
            Err(error) => {
                if !self.ucx.refused(&error) {
                    tracing::debug!(%error, "a UCX read from the kv-store failed; reading over gRPC");
                }
                None
            }
        }
    }
}

impl RemoteStore for KvStoreTier {
    fn put_run(&self, blocks: &[(SequenceHash, Arc<HostBlock>)]) -> usize {
        let fresh: Vec<(SequenceHash, Arc<HostBlock>)> = blocks.iter().filter(|(hash, _)| !self.known.contains_key(hash)).cloned().collect();
        if fresh.is_empty() {
            return blocks.len();
        }
        let dropped = fresh.len();
        match self.puts.try_send(fresh) {
            Ok(()) => blocks.len(),
            Err(_) => blocks.len() - dropped,
        }
    }

    fn failed_puts(&self) -> u64 {
        self.failed_puts.load(Relaxed)
    }

    fn get_run(&self, hashes: &[BlockHashes]) -> Result<Vec<Arc<HostBlock>>, RemoteGetError> {
        let sequence: Vec<SequenceHash> = hashes.iter().map(|h| h.sequence).collect();
        // The timer is made inside the runtime: this is the engine's reader thread.
        let answer = self.runtime.block_on(async {
            #[cfg(feature = "ucx")]
            if let Ok(Some(run)) = tokio::time::timeout(self.get_timeout, self.get_over_ucx(&sequence)).await {
                return Ok(Ok(run));
            }
            tokio::time::timeout(self.get_timeout, self.client.get(self.fingerprint, &sequence)).await
        });
        let error = match answer {
            Ok(Ok(run)) => return Ok(self.checked(run, hashes)),
            Ok(Err(error)) => RemoteGetError::Failed(Box::new(error)),
            Err(_) => RemoteGetError::TimedOut(self.get_timeout),
        };
        if !self.get_failed.swap(true, Relaxed) {
            tracing::warn!(%error, "cannot get KV blocks from the kv-store; computing them (logged once)");
        }
        Err(error)
    }
}

impl KvStoreTier {
    /// The leading blocks of `run` whose hashes match `hashes` (the client
    /// checked their checksums), remembered as held.
    fn checked(&self, run: Vec<(SequenceHash, HostBlock)>, hashes: &[BlockHashes]) -> Vec<Arc<HostBlock>> {
        let mut blocks = Vec::with_capacity(run.len());
        for ((sequence, block), want) in run.into_iter().zip(hashes) {
            if sequence != want.sequence || block.local != want.local {
                break;
            }
            self.known.insert(sequence, ());
            blocks.push(Arc::new(block));
        }
        blocks
    }
}
