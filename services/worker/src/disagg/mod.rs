//! Disaggregated serving on a worker.
//!
//! A **prefill** worker computes a prompt ([`Disagg::prefill`]), keeps the
//! prompt's full KV blocks pinned under a lease and returns a
//! [`pb::KvHandle`]: where the blocks are, their hashes and checksums, the
//! layout. A **decode** worker given that handle
//! ([`Disagg::import`]) reads the blocks it does not already cache — UCX
//! one-sided gets of the prefill worker's registered pool when both have
//! UCX, else the `KvTransfer/ReadBlocks` stream — checks every block's
//! checksum, releases the handle, and installs the blocks into its own
//! prefix cache before decoding. Anything wrong on the way (the prefill
//! worker gone, the lease expired, a checksum or layout mismatch, no room)
//! turns into computing the prompt locally: slower, never wrong.

pub mod service;
#[cfg(feature = "ucx")]
pub mod ucx_agent;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use parking_lot::Mutex;
use tokio::sync::Semaphore;
use turbine_engine::{
    EngineHandle, EngineOutput, FinishReason, GenerateRequest, Handoff, ImportedPrefix, KvLayout, KvMemory, block_checksum,
};
use turbine_kv::{BlockHasher, BlockHashes, LocalBlockHash, SequenceHash};
use turbine_proto::worker::v1 as pb;
use turbine_proto::worker::v1::kv_transfer_client::KvTransferClient;
use turbine_runtime::grpc::{MAX_MESSAGE_BYTES, TracedChannel, traced_channel};

use crate::client::{TokenChunk, WorkerError};
use crate::config::{KvTransport, WorkerRole};
use crate::metrics;

/// How long a decode worker waits for a prefill worker's blocks before it
/// computes the prompt itself.
const PULL_TIMEOUT: Duration = Duration::from_secs(10);

/// Read buffers kept for reuse.
const STAGING_BUFFERS: usize = 4;

/// A prefill's outcome: the first token and, unless that finished the
/// request, the handle of the pinned blocks.
#[derive(Debug, Clone)]
pub struct Prefilled {
    /// The first token (none when a stop token ended the request).
    pub first: TokenChunk,
    /// The pinned blocks; `None` when `first` finished the request.
    pub handle: Option<pb::KvHandle>,
    /// Prompt tokens the prefill served from its prefix cache.
    pub cached_prompt_tokens: u32,
}

/// Blocks pinned for a decode worker.
#[derive(Debug)]
struct Pin {
    pin_id: u64,
    blocks: Vec<u32>,
}

/// A worker's disaggregated-serving state.
pub struct Disagg {
    worker_id: String,
    role: WorkerRole,
    engine: EngineHandle,
    memory: Option<KvMemory>,
    /// Random per start: tells readers when cached descriptions go stale.
    memory_id: u64,
    lease: Duration,
    transport: KvTransport,
    simulated: Option<SimulatedTransfer>,
    /// MiB of blocks in flight to this worker.
    budget: Arc<Semaphore>,
    budget_mib: usize,
    /// Where peers reach this worker's KvTransfer.
    endpoint: OnceLock<String>,
    /// Handles by id. The lock is held while a block is copied out, so a
    /// release (which unpins after removing) never overlaps a copy.
    pins: Arc<Mutex<HashMap<u64, Pin>>>,
    clients: Mutex<HashMap<String, KvTransferClient<TracedChannel>>>,
    /// Read buffers given back after their blocks were installed (reused:
    /// fresh pages would be faulted in on every read).
    staging: Arc<Mutex<Vec<Vec<u8>>>>,
    #[cfg(feature = "ucx")]
    ucx: Option<ucx_agent::UcxAgent>,
    /// Peers' UCX regions by memory id (None: the peer has no UCX).
    #[cfg(feature = "ucx")]
    regions: Mutex<HashMap<u64, Option<pb::UcxRegion>>>,
}

impl std::fmt::Debug for Disagg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Disagg").field("role", &self.role).field("pins", &self.pins.lock().len()).finish_non_exhaustive()
    }
}

/// Settings of [`Disagg::new`].
#[derive(Debug, Clone)]
pub struct DisaggOptions {
    /// The worker's role.
    pub role: WorkerRole,
    /// How long pins wait for a release.
    pub lease: Duration,
    /// How to read peers' blocks.
    pub transport: KvTransport,
    /// MiB of blocks in flight to this worker.
    pub transfer_mib: usize,
    /// Engines without KV memory (the mocker): hand-offs move no bytes but
    /// take the time these would take.
    pub simulated: Option<SimulatedTransfer>,
    /// Where the engine's pool was allocated (see [`SharedKvPool`]).
    pub pool: SharedKvPool,
}

/// Shared memory for a prefill worker's KV pool: with UCX, the pool is
/// allocated by UCX's shared-memory allocator so that decode workers on
/// the same machine map it and copy blocks out without the prefill
/// worker's help. Empty (the heap) for other roles, for `--kv-transport
/// tcp`, when `UCX_TLS` is set, and without the `ucx` feature.
#[derive(Debug, Clone, Default)]
pub struct SharedKvPool {
    #[cfg(feature = "ucx")]
    shm: Option<Arc<ucx_agent::ShmPool>>,
}

impl SharedKvPool {
    /// The pool for a worker of `role` moving blocks over `transport`.
    pub fn for_role(role: WorkerRole, transport: KvTransport) -> Self {
        #[cfg(feature = "ucx")]
        return Self { shm: (role == WorkerRole::Prefill && transport != KvTransport::Tcp).then(ucx_agent::ShmPool::open).flatten() };
        #[cfg(not(feature = "ucx"))]
        {
            let _ = (role, transport);
            Self::default()
        }
    }

    /// The allocator to give the engine (None: the heap).
    pub fn allocator(&self) -> Option<turbine_engine::KvAllocator> {
        #[cfg(feature = "ucx")]
        return self.shm.as_ref().map(ucx_agent::ShmPool::allocator);
        #[cfg(not(feature = "ucx"))]
        None
    }
}

/// A modelled KV transfer (for mocker workers): blocks of `block_bytes`
/// read at `bytes_per_sec`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimulatedTransfer {
    /// Bytes of one block of the modelled model.
    pub block_bytes: usize,
    /// Modelled bandwidth (already divided by any simulation speedup).
    pub bytes_per_sec: f64,
}

impl SimulatedTransfer {
    fn layout(&self) -> KvLayout {
        KvLayout::opaque(self.block_bytes, "simulated")
    }
}

impl Disagg {
    /// The state of a worker whose engine exposes `memory` (None: this
    /// worker computes every prompt itself and serves no blocks).
    pub fn new(worker_id: &str, engine: EngineHandle, memory: Option<KvMemory>, options: &DisaggOptions) -> Self {
        #[cfg(feature = "ucx")]
        let ucx = match (options.transport, options.role) {
            (KvTransport::Tcp, WorkerRole::Aggregated) => None,
            _ if options.simulated.is_some() => None,
            _ => match ucx_agent::UcxAgent::start(memory.as_ref(), options.pool.shm.clone()) {
                Ok(agent) => Some(agent),
                Err(error) => {
                    tracing::warn!(%error, "UCX is unavailable; KV blocks move over TCP");
                    None
                }
            },
        };
        Self {
            worker_id: worker_id.to_owned(),
            role: options.role,
            engine,
            memory,
            memory_id: rand_u64(),
            lease: options.lease,
            transport: options.transport,
            simulated: options.simulated,
            budget: Arc::new(Semaphore::new(options.transfer_mib)),
            budget_mib: options.transfer_mib,
            endpoint: OnceLock::new(),
            pins: Arc::new(Mutex::new(HashMap::new())),
            clients: Mutex::new(HashMap::new()),
            staging: Arc::new(Mutex::new(Vec::new())),
            #[cfg(feature = "ucx")]
            ucx,
            #[cfg(feature = "ucx")]
            regions: Mutex::new(HashMap::new()),
        }
    }

    /// The layout of the blocks this worker hands over and takes in (the
    /// modelled one for a mocker); `None` when it does neither.
    fn layout(&self) -> Option<KvLayout> {
        self.memory.as_ref().map(|memory| memory.layout().clone()).or_else(|| self.simulated.map(|simulated| simulated.layout()))
    }

    /// The worker's role.
    pub fn role(&self) -> WorkerRole {
        self.role
    }

    /// Sets where peers reach this worker's KvTransfer (once).
    pub fn set_endpoint(&self, endpoint: String) {
        let _ = self.endpoint.set(endpoint);
    }

    /// Where peers reach this worker's KvTransfer, once served.
    pub fn endpoint(&self) -> Option<&str> {
        self.endpoint.get().map(String::as_str)
    }

    /// Handles currently pinned.
    pub fn pinned_handles(&self) -> usize {
        self.pins.lock().len()
    }

    /// Whether this worker reads peers' blocks over UCX.
    pub fn has_ucx(&self) -> bool {
        #[cfg(feature = "ucx")]
        return self.ucx.is_some();
        #[cfg(not(feature = "ucx"))]
        false
    }

    /// Computes `request`'s prompt and first token and pins the prompt's
    /// blocks for a decode worker (see the module). `request.stop.max_tokens`
    /// is the whole request's; one token is generated here.
    pub async fn prefill(&self, mut request: GenerateRequest, lease: Option<Duration>) -> Result<Prefilled, WorkerError> {
        if self.layout().is_none() {
            return Err(WorkerError::InvalidArgument("this worker's engine cannot hand its KV cache to another worker".into()));
        }
        if self.endpoint().is_none() {
            return Err(WorkerError::Unavailable("this worker does not serve KvTransfer yet".into()));
        }
        // Checked as the whole request, so a decode worker will accept it.
        self.engine.config().validate(&request).map_err(|error| WorkerError::InvalidArgument(error.to_string()))?;
        let wanted = request.stop.max_tokens;
        request.stop.max_tokens = 1;
        let mut outputs = self.engine.submit(request, Handoff::Prefill)?;
        let mut pin = None;
        let mut first = TokenChunk::default();
        loop {
            match outputs.recv().await {
                Some(EngineOutput::Pinned(pinned)) => pin = Some((UnpinOnDrop { engine: self.engine.clone(), pin_id: pinned.pin_id, armed: true }, pinned.blocks)),
                Some(EngineOutput::Token(token, logprobs)) => {
                    first.tokens.push(token);
                    first.logprobs.extend(logprobs);
                }
                Some(EngineOutput::Finished { reason, usage }) => {
                    first.finished = Some((reason, usage));
                    break;
                }
                Some(EngineOutput::Failed(error)) => return Err(error.into()),
                None => return Err(WorkerError::Unavailable("the engine stopped".into())),
            }
        }
        let (reason, usage) = first.finished.take().expect("the loop ends on Finished");
        let Some((guard, blocks)) = pin else { return Err(WorkerError::Internal("the engine pinned no blocks".into())) };
        let finished = reason == FinishReason::Stop || wanted <= 1;
        if finished || blocks.is_empty() {
            // Nothing to continue, or a prompt under one block: nothing to
            // move (a decode worker computes it itself).
            drop(guard);
            first.finished = finished.then_some((reason, usage));
            return Ok(Prefilled { first, handle: None, cached_prompt_tokens: usage.cached_prompt_tokens });
        }
        let handle = self.share(guard.pin_id, &blocks, lease.unwrap_or(self.lease)).await?;
        guard.disarm();
        Ok(Prefilled { first, handle: Some(handle), cached_prompt_tokens: usage.cached_prompt_tokens })
    }

    /// Offers pinned blocks to other workers: checksums them, registers a
    /// handle for `lease`, and returns it. `pin_id` is the engine's pin,
    /// released with the handle (an id the engine never gave, such as 0,
    /// releases nothing: blocks pinned some other way).
    pub async fn share(&self, pin_id: u64, blocks: &[(u32, BlockHashes)], lease: Duration) -> Result<pb::KvHandle, WorkerError> {
        let endpoint = self.endpoint().ok_or_else(|| WorkerError::Unavailable("this worker does not serve KvTransfer yet".into()))?.to_owned();
        let ids: Vec<u32> = blocks.iter().map(|(block, _)| *block).collect();
        let (layout, offsets, checksums) = match (&self.memory, &self.simulated) {
            (Some(memory), _) => {
                if let Some(bad) = ids.iter().find(|&&block| block as usize >= memory.num_blocks()) {
                    return Err(WorkerError::InvalidArgument(format!("block {bad} is outside the pool")));
                }
                let offsets = ids.iter().map(|&block| memory.block_offset(block) as u64).collect();
                (memory.layout().clone(), offsets, self.checksums(memory, &ids).await?)
            }
            (None, Some(simulated)) => (simulated.layout(), vec![0; ids.len()], vec![0; ids.len()]),
            (None, None) => return Err(WorkerError::InvalidArgument("this worker's engine cannot hand its KV cache to another worker".into())),
        };
        let handle_id = rand_u64();
        let handle = pb::KvHandle {
            worker_id: self.worker_id.clone(),
            transfer_endpoint: endpoint,
            handle_id,
            layout: Some(layout_to_proto(&layout)),
            blocks: blocks
                .iter()
                .zip(offsets.iter().zip(&checksums))
                .map(|((_, hashes), (&offset, &checksum))| pb::KvBlockRef { sequence_hash: hashes.sequence.0, local_hash: hashes.local.0, offset, checksum })
                .collect(),
            lease_expires_unix_ms: unix_ms(SystemTime::now() + lease),
            memory_id: self.memory_id,
        };
        self.register(handle_id, Pin { pin_id, blocks: ids }, lease);
        Ok(handle)
    }

    /// Checksums of pinned blocks, computed off the async threads.
    async fn checksums(&self, memory: &KvMemory, ids: &[u32]) -> Result<Vec<u64>, WorkerError> {
        let (memory, ids) = (memory.clone(), ids.to_vec());
        tokio::task::spawn_blocking(move || {
            let mut scratch = Vec::new();
            // SAFETY: the caller keeps the blocks pinned until the handle
            // is released.
            #[allow(unsafe_code)]
            let sums: Result<Vec<u64>, String> = ids.iter().map(|&block| unsafe { memory.with_block(block, &mut scratch, block_checksum) }).collect();
            sums
        })
        .await
        .map_err(|_| WorkerError::Internal("checksumming panicked".into()))?
        .map_err(|error| WorkerError::Internal(format!("reading a KV block off the device: {error}")))
    }

    /// Records a handle and starts its lease: the blocks are freed if
    /// nobody releases them in time.
    fn register(&self, handle_id: u64, pin: Pin, lease: Duration) {
        self.pins.lock().insert(handle_id, pin);
        metrics::kv_pins(&self.worker_id, 1);
        let (pins, engine, worker_id) = (self.pins.clone(), self.engine.clone(), self.worker_id.clone());
        tokio::spawn(async move {
            tokio::time::sleep(lease).await;
            let expired = pins.lock().remove(&handle_id);
            if let Some(pin) = expired {
                engine.unpin(pin.pin_id);
                metrics::kv_pins(&worker_id, -1);
                metrics::kv_lease_expired(&worker_id);
                tracing::debug!(handle_id, "a prefill's lease expired before its decode worker released it");
            }
        });
    }

    /// Unpins a handle; false if it was unknown (released or expired).
    pub fn release(&self, handle_id: u64) -> bool {
        let pin = self.pins.lock().remove(&handle_id);
        match pin {
            Some(pin) => {
                self.engine.unpin(pin.pin_id);
                metrics::kv_pins(&self.worker_id, -1);
                true
            }
            None => false,
        }
    }

    /// Blocks of a handle.
    pub(crate) fn block_count(&self, handle_id: u64) -> Result<usize, tonic::Status> {
        let pins = self.pins.lock();
        let pin = pins.get(&handle_id).ok_or_else(|| tonic::Status::not_found(format!("no KV handle {handle_id} (released or expired)")))?;
        Ok(pin.blocks.len())
    }

    /// Copies block `index` of a handle.
    pub(crate) fn copy_block(&self, handle_id: u64, index: usize) -> Result<Vec<u8>, tonic::Status> {
        let memory = self.memory.as_ref().ok_or_else(|| tonic::Status::not_found("this worker holds no KV blocks for others"))?;
        let pins = self.pins.lock();
        let pin = pins.get(&handle_id).ok_or_else(|| tonic::Status::not_found(format!("no KV handle {handle_id} (released or expired)")))?;
        let &block = pin.blocks.get(index).ok_or_else(|| tonic::Status::invalid_argument(format!("the handle has {} blocks, not {}", pin.blocks.len(), index + 1)))?;
        // SAFETY: pinned while the table lock is held (a release removes
        // the pin under this lock before unpinning).
        #[allow(unsafe_code)]
        let bytes = unsafe { memory.with_block(block, &mut Vec::new(), <[u8]>::to_vec) };
        bytes.map_err(|error| tonic::Status::internal(format!("reading KV block {index} off the device: {error}")))
    }

    /// What `Describe` answers.
    pub(crate) fn describe(&self, handle_id: u64) -> Result<pb::DescribeResponse, tonic::Status> {
        let memory = self.memory.as_ref().ok_or_else(|| tonic::Status::not_found("this worker holds no KV blocks for others"))?;
        if !self.pins.lock().contains_key(&handle_id) {
            return Err(tonic::Status::not_found(format!("no KV handle {handle_id} (released or expired)")));
        }
        #[cfg(feature = "ucx")]
        let ucx = self.ucx.as_ref().and_then(|agent| agent.region().cloned());
        #[cfg(not(feature = "ucx"))]
        let ucx = None;
        Ok(pb::DescribeResponse { layout: Some(layout_to_proto(memory.layout())), ucx, memory_id: self.memory_id })
    }

    /// The blocks of `remote` this worker should install before decoding
    /// `request`: read, checked, handle released. Never fails: anything
    /// wrong yields fewer (or no) blocks and the prompt is computed here.
    pub async fn import(&self, request: &GenerateRequest, remote: &pb::RemotePrefill) -> ImportedPrefix {
        let Some(handle) = &remote.handle else { return ImportedPrefix::default() };
        let started = Instant::now();
        let _in_flight = metrics::ImportInFlight::start(&self.worker_id);
        // Once the blocks are read (or will never be, this call cancelled
        // included), the prefill worker can let them go.
        let _release = self.client(&handle.transfer_endpoint).ok().map(|client| ReleaseRemote { client, handle_id: handle.handle_id });
        let outcome = self.try_import(request, handle).await;
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

    async fn try_import(&self, request: &GenerateRequest, handle: &pb::KvHandle) -> Result<(ImportedPrefix, &'static str, usize), ImportError> {
        let local_layout = self.layout().ok_or(ImportError::NoMemory)?;
        let layout = handle.layout.as_ref().map(layout_from_proto).ok_or(ImportError::Layout)?;
        if layout != local_layout {
            return Err(ImportError::Layout);
        }
        if unix_ms(SystemTime::now()) >= handle.lease_expires_unix_ms {
            return Err(ImportError::Expired);
        }
        // The handle must describe this very prompt, hashed as this engine
        // hashes it: installed blocks serve later requests.
        let config = self.engine.config();
        let expected = BlockHasher::with_seed(config.hash_seed).sequence_hashes(&request.prompt, config.block_size);
        let hashes: Vec<BlockHashes> = handle
            .blocks
            .iter()
            .map(|block| BlockHashes { local: LocalBlockHash(block.local_hash), sequence: SequenceHash(block.sequence_hash) })
            .collect();
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
            return Ok((ImportedPrefix { parent, hashes: hashes[cached..].to_vec(), ..ImportedPrefix::default() }, "simulated", bytes));
        }
        let permits = bytes.div_ceil(1 << 20).max(1);
        if permits > self.budget_mib {
            return Err(ImportError::Budget);
        }
        let _permit = self.budget.try_acquire_many(permits as u32).map_err(|_| ImportError::Budget)?;
        let (bytes, transport) = self.read(handle, &wanted, layout.block_bytes).await?;
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
        Ok((ImportedPrefix { parent, hashes: hashes[cached..].to_vec(), bytes, recycle: Some(recycle) }, transport, pulled))
    }

    /// Reads blocks `wanted` of a handle: UCX when allowed and possible,
    /// else (or when UCX fails, in auto mode) the gRPC stream.
    async fn read(&self, handle: &pb::KvHandle, wanted: &[usize], block_bytes: usize) -> Result<(Vec<u8>, &'static str), ImportError> {
        #[cfg(feature = "ucx")]
        if self.transport != KvTransport::Tcp {
            match self.read_ucx(handle, wanted, block_bytes).await {
                Ok(bytes) => return Ok((bytes, "ucx")),
                Err(error) if self.transport == KvTransport::Ucx => return Err(error),
                Err(error) => tracing::debug!(%error, "UCX read failed; reading over TCP"),
            }
        }
        #[cfg(not(feature = "ucx"))]
        if self.transport == KvTransport::Ucx {
            return Err(ImportError::Transfer("this build has no UCX (rebuild with --features ucx)".into()));
        }
        let bytes = tokio::time::timeout(PULL_TIMEOUT, self.read_tcp(handle, wanted, block_bytes)).await.map_err(|_| ImportError::Transfer("timed out".into()))??;
        Ok((bytes, "tcp"))
    }

    #[cfg(feature = "ucx")]
    async fn read_ucx(&self, handle: &pb::KvHandle, wanted: &[usize], block_bytes: usize) -> Result<Vec<u8>, ImportError> {
        let agent = self.ucx.as_ref().ok_or_else(|| ImportError::Transfer("this worker has no UCX".into()))?;
        let known = self.regions.lock().get(&handle.memory_id).cloned();
        let region = match known {
            Some(region) => region,
            None => {
                let described = self.client(&handle.transfer_endpoint)?.describe(pb::DescribeRequest { handle_id: handle.handle_id }).await;
                let described = described.map_err(|status| ImportError::Transfer(format!("describe: {}", status.message())))?.into_inner();
                self.regions.lock().insert(described.memory_id, described.ucx.clone());
                described.ucx
            }
        };
        let region = region.ok_or_else(|| ImportError::Transfer("the prefill worker has no UCX".into()))?;
        let offsets: Vec<u64> = wanted.iter().map(|&index| handle.blocks[index].offset).collect();
        // A second plus the time at 0.5 GB/s (far below any UCX transport's),
        // at most PULL_TIMEOUT: a dead peer costs no more than that.
        let deadline = (Duration::from_secs(1) + Duration::from_secs_f64((offsets.len() * block_bytes) as f64 / 0.5e9)).min(PULL_TIMEOUT);
        let pulled = agent.pull(&region, &offsets, block_bytes, self.staging_buffer(), deadline).await.map_err(ImportError::Transfer)?;
        metrics::kv_ucx_read(&self.worker_id, pulled.post, pulled.mapped);
        Ok(pulled.bytes)
    }

    async fn read_tcp(&self, handle: &pb::KvHandle, wanted: &[usize], block_bytes: usize) -> Result<Vec<u8>, ImportError> {
        read_blocks_tcp(self.client(&handle.transfer_endpoint)?, handle.handle_id, wanted, block_bytes, self.staging_buffer()).await.map_err(ImportError::Transfer)
    }

    /// A buffer to read into: a recycled one if any.
    fn staging_buffer(&self) -> Vec<u8> {
        self.staging.lock().pop().unwrap_or_default()
    }

    fn client(&self, endpoint: &str) -> Result<KvTransferClient<TracedChannel>, ImportError> {
        let mut clients = self.clients.lock();
        if let Some(client) = clients.get(endpoint) {
            return Ok(client.clone());
        }
        let channel = traced_channel(endpoint).map_err(|error| ImportError::Transfer(format!("bad transfer endpoint {endpoint:?}: {error}")))?;
        let client = KvTransferClient::new(channel).max_decoding_message_size(MAX_MESSAGE_BYTES).max_encoding_message_size(MAX_MESSAGE_BYTES);
        clients.insert(endpoint.to_owned(), client.clone());
        Ok(client)
    }

}

/// Releases a handle on its worker, in the background, when dropped.
struct ReleaseRemote {
    client: KvTransferClient<TracedChannel>,
    handle_id: u64,
}

impl Drop for ReleaseRemote {
    fn drop(&mut self) {
        release_in_background(self.client.clone(), self.handle_id);
    }
}

/// Reads blocks `wanted` (indices into the handle) of a handle over the
/// `KvTransfer/ReadBlocks` stream, back to back.
pub async fn read_blocks_tcp(
    mut client: KvTransferClient<TracedChannel>,
    handle_id: u64,
    wanted: &[usize],
    block_bytes: usize,
    mut bytes: Vec<u8>,
) -> Result<Vec<u8>, String> {
    let request = pb::ReadBlocksRequest { handle_id, indices: wanted.iter().map(|&i| i as u32).collect() };
    let transfer = |status: tonic::Status| format!("read blocks: {}", status.message());
    let mut stream = client.read_blocks(request).await.map_err(transfer)?.into_inner();
    bytes.clear();
    bytes.reserve(wanted.len() * block_bytes);
    for &index in wanted {
        let block = stream.next().await.ok_or("the block stream ended early")?.map_err(transfer)?;
        if block.index as usize != index || block.data.len() != block_bytes {
            return Err(format!("block {} of {} bytes where block {index} of {block_bytes} was due", block.index, block.data.len()));
        }
        bytes.extend_from_slice(&block.data);
    }
    Ok(bytes)
}

/// Releases a handle on the worker holding it, in the background on the
/// current runtime (none: nothing is sent); a failed release leaves the
/// handle's lease to free its blocks. For a decode worker done reading, or
/// a caller that will not pass the handle on (e.g. a cancelled request).
pub fn release_in_background(mut client: KvTransferClient<TracedChannel>, handle_id: u64) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
    runtime.spawn(async move {
        if let Err(status) = client.release(pb::ReleaseRequest { handle_id }).await {
            tracing::debug!(handle_id, error = %status.message(), "releasing a KV handle failed; its lease frees it");
        }
    });
}

/// [`release_in_background`] for a handle, by its transfer endpoint.
pub fn release_handle_in_background(handle: &pb::KvHandle) {
    match traced_channel(&handle.transfer_endpoint) {
        Ok(channel) => release_in_background(KvTransferClient::new(channel), handle.handle_id),
        Err(error) => tracing::debug!(%error, handle_id = handle.handle_id, "bad transfer endpoint; the handle's lease frees its blocks"),
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

/// Unpins on drop unless disarmed: a prefill cancelled between the pin and
/// the handle's registration leaves nothing pinned.
struct UnpinOnDrop {
    engine: EngineHandle,
    pin_id: u64,
    armed: bool,
}

impl UnpinOnDrop {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for UnpinOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.engine.unpin(self.pin_id);
        }
    }
}

/// The wire form of a layout.
pub fn layout_to_proto(layout: &KvLayout) -> pb::KvLayout {
    pb::KvLayout {
        block_bytes: layout.block_bytes as u64,
        block_size: layout.block_size as u32,
        layers: layout.layers as u32,
        kv_heads: layout.kv_heads as u32,
        head_dim: layout.head_dim as u32,
        dtype: layout.dtype.clone(),
        order: layout.order.clone(),
    }
}

/// A layout from the wire.
pub fn layout_from_proto(layout: &pb::KvLayout) -> KvLayout {
    KvLayout {
        block_bytes: layout.block_bytes as usize,
        block_size: layout.block_size as usize,
        layers: layout.layers as usize,
        kv_heads: layout.kv_heads as usize,
        head_dim: layout.head_dim as usize,
        dtype: layout.dtype.clone(),
        order: layout.order.clone(),
    }
}

fn unix_ms(time: SystemTime) -> i64 {
    time.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

fn rand_u64() -> u64 {
    uuid::Uuid::new_v4().as_u64_pair().0
}
