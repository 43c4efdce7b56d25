//! The decode side: read a prefill's blocks (UCX, else the gRPC stream),
//! check them, release the handle, hand them to the engine.

use std::time::{Duration, Instant, SystemTime};

use turbine_api::kv_transfer::KvTransferClient;
use turbine_api::worker::{HandleKey, KvHandle};
use turbine_engine::{GenerateRequest, ImportedPrefix, block_checksum};
use turbine_kv::{BlockHasher, BlockHashes};

use super::Disagg;
use crate::config::KvTransport;
use crate::metrics;

/// How long a decode worker waits for a prefill worker's blocks before it
/// computes the prompt itself.
const PULL_TIMEOUT: Duration = Duration::from_secs(10);

/// Read buffers kept for reuse.
const STAGING_BUFFERS: usize = 4;

impl Disagg {
    /// The blocks of `handle` this worker should install before decoding
    /// `request`: read, checked, handle released. Never fails: anything
    /// wrong yields fewer (or no) blocks and the prompt is computed here.
    pub async fn import(&self, request: &GenerateRequest, handle: Option<&KvHandle>) -> ImportedPrefix {
        let Some(handle) = handle else {
            return ImportedPrefix::default();
        };
        let started = Instant::now();
        let _in_flight = metrics::ImportInFlight::start(&self.worker_id);
        // Once the blocks are read (or will never be, this call cancelled
        // included), the prefill worker can let them go.
        let peer = KvTransferClient::connect(&handle.transfer_endpoint).ok();
        let _release = peer.clone().map(|client| ReleaseRemote { client, handle: handle.key() });
        let outcome = match peer {
            Some(peer) => self.try_import(request, handle, &peer).await,
            None => Err(ImportError::Transfer(format!("bad transfer endpoint {:?}", handle.transfer_endpoint))),
        };
        match outcome {
            Ok((import, transport, pulled)) => {
                metrics::kv_import(&self.worker_id, transport, "ok", pulled, started.elapsed());
                import
            }
            Err(reason) => {
                tracing::warn!(request_id = %request.request_id, reason = reason.label(), cause = %reason, "computing the prompt locally instead of reading it from the prefill worker");
                metrics::kv_import(&self.worker_id, "none", reason.label(), 0, started.elapsed());
                ImportedPrefix::default()
            }
        }
    }

    async fn try_import(
        &self,
        request: &GenerateRequest,
        handle: &KvHandle,
        peer: &KvTransferClient,
    ) -> Result<(ImportedPrefix, &'static str, usize), ImportError> {
        let layout = self.layout().ok_or(ImportError::NoMemory)?;
        if handle.layout != layout {
            return Err(ImportError::Layout);
        }
        if SystemTime::now() >= handle.lease_expires {
            return Err(ImportError::Expired);
        }
        // The handle must describe this very prompt, hashed as this engine
        // hashes it: installed blocks serve later requests.
        let config = self.engine.config();
        let expected = BlockHasher::salted(config.hash_seed, request.cache_salt).sequence_hashes(&request.prompt, config.block_size);
        let hashes: Vec<BlockHashes> = handle.blocks.iter().map(|block| block.hashes).collect();
        if hashes.len() > expected.len() || hashes.iter().zip(&expected).any(|(ours, theirs)| ours.sequence != *theirs) {
            return Err(ImportError::Hashes);
        }
        let cached = self.engine.cached_prefix(hashes.iter().map(|h| h.sequence).collect()).await.map_err(|_| ImportError::ShuttingDown)?;
        if cached == hashes.len() {
            return Ok((ImportedPrefix::default(), "cached", 0));
        }
        let wanted: Vec<usize> = (cached..hashes.len()).collect();
        let bytes = wanted.len() * layout.block_bytes;
        let parent = cached.checked_sub(1).map(|i| hashes[i].sequence);
        if let Some(simulated) = &self.simulated {
            // Modelled: no bytes are held, only the time is taken.
            tokio::time::sleep(Duration::from_secs_f64(bytes as f64 / simulated.bytes_per_sec)).await;
            return Ok((
                ImportedPrefix { parent, hashes: hashes[cached..].to_vec(), tenant: request.kv_tenant, ..ImportedPrefix::default() },
                "simulated",
                bytes,
            ));
        }
        let permits = bytes.div_ceil(1 << 20).max(1);
        if permits > self.budget_mib {
            return Err(ImportError::Budget);
        }
        let _permit = self.budget.try_acquire_many(permits as u32).map_err(|_| ImportError::Budget)?;
        let (bytes, transport) = self.read(handle, peer, &wanted, layout.block_bytes).await?;
        for (chunk, &index) in bytes.chunks(layout.block_bytes).zip(&wanted) {
            if block_checksum(chunk) != handle.blocks[index].checksum {
                metrics::kv_checksum_mismatch(&self.worker_id);
                return Err(ImportError::Checksum(index));
            }
        }
        let pulled = bytes.len();
        let staging = self.staging.clone();
        let recycle: Box<dyn FnOnce(Vec<u8>) + Send> = Box::new(move |buffer| {
            let mut staging = staging.lock();
            if staging.len() < STAGING_BUFFERS {
                staging.push(buffer);
            }
        });
        Ok((ImportedPrefix { parent, hashes: hashes[cached..].to_vec(), tenant: request.kv_tenant, bytes, recycle: Some(recycle) }, transport, pulled))
    }

    /// Reads blocks `wanted` of a handle: UCX when allowed and possible,
    /// else (or when UCX fails, in auto mode) the gRPC stream.
    async fn read(&self, handle: &KvHandle, peer: &KvTransferClient, wanted: &[usize], block_bytes: usize) -> Result<(Vec<u8>, &'static str), ImportError> {
        #[cfg(feature = "ucx")]
        if self.transport != KvTransport::Tcp {
            match self.read_ucx(handle, peer, wanted, block_bytes).await {
                Ok(bytes) => return Ok((bytes, "ucx")),
                Err(error) if self.transport == KvTransport::Ucx => return Err(error),
                Err(error) => tracing::debug!(%error, "UCX read failed; reading over TCP"),
            }
        }
        #[cfg(not(feature = "ucx"))]
        if self.transport == KvTransport::Ucx {
            return Err(ImportError::Transfer("this build has no UCX (rebuild with --features ucx)".into()));
        }
        let read = peer.read_blocks(handle.key(), wanted, block_bytes, self.staging_buffer());
        let bytes = tokio::time::timeout(PULL_TIMEOUT, read).await.map_err(|_| ImportError::Transfer("timed out".into()))?;
        Ok((bytes.map_err(|error| ImportError::Transfer(format!("read blocks: {error}")))?, "tcp"))
    }

    #[cfg(feature = "ucx")]
    async fn read_ucx(&self, handle: &KvHandle, peer: &KvTransferClient, wanted: &[usize], block_bytes: usize) -> Result<Vec<u8>, ImportError> {
        let agent = self.ucx.as_ref().ok_or_else(|| ImportError::Transfer("this worker has no UCX".into()))?;
        let known = self.regions.lock().get(&handle.memory_id).cloned();
        let region = match known {
            Some(region) => region,
            None => {
                let described = peer.describe(handle.key()).await.map_err(|error| ImportError::Transfer(format!("describe: {error}")))?;
                // A pool keyed per handle is described for each handle:
                // its keys open this handle's blocks only.
                if described.ucx.as_ref().is_none_or(|region| region.range_keys.is_empty()) {
                    self.regions.lock().insert(described.memory_id, described.ucx.clone());
                }
                described.ucx
            }
        };
        let region = region.ok_or_else(|| ImportError::Transfer("the prefill worker has no UCX".into()))?;
        let offsets: Vec<u64> = wanted.iter().map(|&index| handle.blocks[index].offset).collect();
        // A second plus the time at 0.5 GB/s (far below any UCX transport's),
        // at most PULL_TIMEOUT: a dead peer costs no more than that.
        let deadline = (Duration::from_secs(1) + Duration::from_secs_f64((offsets.len() * block_bytes) as f64 / 0.5e9)).min(PULL_TIMEOUT);
        let pulled =
            agent.pull(&region, &offsets, block_bytes, self.staging_buffer(), deadline).await.map_err(|error| ImportError::Transfer(error.to_string()))?;
        metrics::kv_ucx_read(&self.worker_id, pulled.post, pulled.mapped);
        Ok(pulled.bytes)
    }

    /// A buffer to read into: a recycled one if any.
    fn staging_buffer(&self) -> Vec<u8> {
        self.staging.lock().pop().unwrap_or_default()
    }
}

/// Releases a handle on its worker, in the background, when dropped.
struct ReleaseRemote {
    client: KvTransferClient,
    handle: HandleKey,
}

impl Drop for ReleaseRemote {
    fn drop(&mut self) {
        self.client.release_in_background(self.handle);
    }
}

/// Why a decode worker computes a prompt itself.
#[derive(Debug, thiserror::Error)]
enum ImportError {
    #[error("this worker's engine cannot install KV blocks")]
    NoMemory,
    #[error("the prefill worker's KV layout differs from this worker's")]
    Layout,
    #[error("the handle's lease has expired")]
    Expired,
    #[error("the handle's block hashes do not match the prompt")]
    Hashes,
    #[error("the engine is shutting down")]
    ShuttingDown,
    #[error("too many KV blocks are in flight to this worker")]
    Budget,
    #[error("block {0} failed its checksum")]
    Checksum(usize),
    #[error("{0}")]
    Transfer(String),
}

impl ImportError {
    fn label(&self) -> &'static str {
        match self {
            ImportError::NoMemory => "no_memory",
            ImportError::Layout => "layout",
            ImportError::Expired => "expired",
            ImportError::Hashes => "hashes",
            ImportError::ShuttingDown => "shutting_down",
            ImportError::Budget => "budget",
            ImportError::Checksum(_) => "checksum",
            ImportError::Transfer(_) => "transfer",
        }
    }
}
