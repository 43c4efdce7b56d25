//! The prefill side: compute a prompt, pin its blocks under a lease, hand
//! out a handle, serve the blocks to the decode worker, release.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use turbine_api::kv_transfer::{Described, KvTransferApi};
use turbine_api::worker::{HandleKey, HandleToken, KvBlockRef, KvHandle, Prefilled, TokenChunk, WorkerError};
use turbine_engine::{EngineHandle, EngineOutput, FinishReason, GenerateRequest, Handoff, KvMemory, block_checksum};
use turbine_kv::BlockHashes;
#[cfg(feature = "ucx")]
use turbine_kv::{UcxRegion, WorkerId};
use turbine_runtime::trust::Refusal;

use super::{Disagg, Pin, rand_u64};
use crate::metrics;

impl Disagg {
    /// Computes `request`'s prompt and first token and pins the prompt's
    /// blocks for a decode worker (see the module). `request.stop.max_tokens`
    /// is the whole request's; one token is generated here. `requester`
    /// names the caller, whose handles may pin only its share of the pool.
    pub async fn prefill(&self, requester: &str, mut request: GenerateRequest, lease: Option<Duration>) -> Result<Prefilled, WorkerError> {
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
        let request_id = request.request_id.clone();
        let mut outputs = self.engine.submit(request, Handoff::Prefill).map_err(crate::local::worker_error)?;
        let mut pin = None;
        let mut first = TokenChunk::default();
        loop {
            match outputs.recv().await {
                Some(EngineOutput::Pinned(pinned)) => {
                    pin = Some((UnpinOnDrop { engine: self.engine.clone(), pin_id: pinned.pin_id, armed: true }, pinned.blocks))
                }
                Some(EngineOutput::Token(token, logprobs)) => {
                    first.tokens.push(token);
                    first.logprobs.extend(logprobs);
                }
                Some(EngineOutput::Finished { reason, usage }) => {
                    first.finished = Some((reason, usage));
                    break;
                }
                Some(EngineOutput::Failed(error)) => return Err(crate::local::worker_error(error)),
                None => return Err(WorkerError::Unavailable("the engine stopped".into())),
            }
        }
        let (reason, usage) = first.finished.take().expect("the loop ends on Finished");
        let Some((guard, blocks)) = pin else {
            return Err(WorkerError::Internal("the engine pinned no blocks".into()));
        };
        let finished = reason == FinishReason::Stop || wanted <= 1;
        if finished || blocks.is_empty() {
            // Nothing to continue, or a prompt under one block: nothing to
            // move (a decode worker computes it itself).
            drop(guard);
            first.finished = finished.then_some((reason, usage));
            return Ok(Prefilled { first, handle: None, cached_prompt_tokens: usage.cached_prompt_tokens });
        }
        // A caller may shorten the lease, never lengthen it past the
        // worker's: pinned blocks are memory other requests wait for.
        let lease = lease.map_or(self.lease, |asked| asked.min(self.lease));
        let handle = match self.share(requester, guard.pin_id, &blocks, lease).await {
            Ok(handle) => handle,
            Err(WorkerError::Overloaded(why)) => {
                // No room for more pins: the decode worker computes the
                // prompt itself (slower, never wrong).
                tracing::debug!(request_id = %request_id, requester, %why, "handing over no blocks");
                drop(guard);
                return Ok(Prefilled { first, handle: None, cached_prompt_tokens: usage.cached_prompt_tokens });
            }
            Err(error) => return Err(error),
        };
        guard.disarm();
        Ok(Prefilled { first, handle: Some(handle), cached_prompt_tokens: usage.cached_prompt_tokens })
    }

    /// Offers pinned blocks to other workers: checksums them, registers a
    /// handle for `lease`, and returns it. `pin_id` is the engine's pin,
    /// released with the handle (an id the engine never gave, such as 0,
    /// releases nothing: blocks pinned some other way). Overloaded when
    /// the handle would take handles, or `requester`'s, past their share
    /// of the pool (see [`PinBudget`](super::PinBudget)).
    pub async fn share(&self, requester: &str, pin_id: u64, blocks: &[(u32, BlockHashes)], lease: Duration) -> Result<KvHandle, WorkerError> {
        let endpoint = self.endpoint().ok_or_else(|| WorkerError::Unavailable("this worker does not serve KvTransfer yet".into()))?.to_owned();
        let ids: Vec<u32> = blocks.iter().map(|(block, _)| *block).collect();
        // Checked before the checksums' work, and again as the handle is
        // registered (others may have pinned meanwhile).
        self.admit(&self.pins.lock(), requester, ids.len())?;
        let (layout, offsets, checksums) = match (&self.memory, &self.simulated) {
            (Some(memory), _) => {
                if let Some(bad) = ids.iter().find(|&&block| block as usize >= memory.num_blocks()) {
                    return Err(WorkerError::InvalidArgument(format!("block {bad} is outside the pool")));
                }
                let offsets = ids.iter().map(|&block| memory.block_offset(block) as u64).collect();
                (memory.layout().clone(), offsets, self.checksums(memory, &ids).await?)
            }
            (None, Some(simulated)) => (simulated.layout(), vec![0; ids.len()], vec![0; ids.len()]),
            (None, None) => {
                return Err(WorkerError::InvalidArgument("this worker's engine cannot hand its KV cache to another worker".into()));
            }
        };
        let handle_id = rand_u64();
        // ThreadRng is a CSPRNG seeded from the operating system.
        let token = HandleToken::new(rand::random());
        let handle = KvHandle {
            worker_id: self.worker_id.clone(),
            transfer_endpoint: endpoint,
            handle_id,
            token,
            layout,
            blocks: blocks
                .iter()
                .zip(offsets.iter().zip(&checksums))
                .map(|(&(_, hashes), (&offset, &checksum))| KvBlockRef { hashes, offset, checksum })
                .collect(),
            lease_expires: SystemTime::now() + lease,
            memory_id: self.memory_id,
        };
        #[cfg(feature = "ucx")]
        let exposed = self.memory.as_ref().and_then(|memory| self.expose(&offsets, memory.layout().block_bytes as u64));
        let pin = Pin {
            pin_id,
            requester: requester.into(),
            token,
            blocks: ids,
            #[cfg(feature = "ucx")]
            exposed,
        };
        self.register(handle_id, pin, lease)?;
        Ok(handle)
    }

    /// Registers a handle's blocks (at `offsets`, of `block_bytes` each)
    /// with UCX for that handle alone, in runs of adjacent blocks, when
    /// this worker keys its pool per handle. `None` otherwise, and when
    /// UCX refuses (logged): the handle is then read with `ReadBlocks`.
    #[cfg(feature = "ucx")]
    fn expose(&self, offsets: &[u64], block_bytes: u64) -> Option<HandleKeys> {
        let agent = self.ucx.as_ref()?;
        let runs = turbine_ucx_agent::runs(offsets, block_bytes);
        match agent.expose(&runs)? {
            Ok(exposed) => Some(HandleKeys::new(exposed, &self.worker_id)),
            Err(error) => {
                tracing::warn!(%error, runs = runs.len(), "UCX registered none of a handle's blocks; its decode worker reads them over gRPC");
                None
            }
        }
    }

    /// Whether `requester` may pin `blocks` more blocks, given `pins`.
    fn admit(&self, pins: &HashMap<u64, Pin>, requester: &str, blocks: usize) -> Result<(), WorkerError> {
        let (pool_cap, requester_cap) = self.pinned_blocks;
        let (mut pinned, mut by_requester) = (0, 0);
        for pin in pins.values() {
            pinned += pin.blocks.len();
            if &*pin.requester == requester {
                by_requester += pin.blocks.len();
            }
        }
        let refused = if by_requester + blocks > requester_cap {
            Some(("requester_share", format!("{requester} holds {by_requester} pinned blocks; {blocks} more would pass its {requester_cap}")))
        } else if pinned + blocks > pool_cap {
            Some(("pool_share", format!("handles hold {pinned} pinned blocks; {blocks} more would pass the worker's {pool_cap}")))
        } else {
            None
        };
        match refused {
            Some((reason, why)) => {
                metrics::kv_pins_refused(&self.worker_id, reason);
                Err(WorkerError::Overloaded(why))
            }
            None => Ok(()),
        }
    }

    /// Checksums of pinned blocks, computed off the async threads.
    async fn checksums(&self, memory: &KvMemory, ids: &[u32]) -> Result<Vec<u64>, WorkerError> {
        let (memory, ids) = (memory.clone(), ids.to_vec());
        tokio::task::spawn_blocking(move || {
            let mut scratch = Vec::new();
            // SAFETY: the caller keeps the blocks pinned until the handle
            // is released.
            #[allow(unsafe_code)]
            let sums: Result<Vec<u64>, _> = ids.iter().map(|&block| unsafe { memory.with_block(block, &mut scratch, block_checksum) }).collect();
            sums
        })
        .await
        .map_err(|_| WorkerError::Internal("checksumming panicked".into()))?
        .map_err(|error| WorkerError::Internal(format!("reading a KV block off the device: {error}")))
    }

    /// Records a handle and starts its lease: the blocks are freed if
    /// nobody releases them in time. Overloaded (nothing recorded) past the
    /// pin budget.
    fn register(&self, handle_id: u64, pin: Pin, lease: Duration) -> Result<(), WorkerError> {
        {
            let mut pins = self.pins.lock();
            self.admit(&pins, &pin.requester, pin.blocks.len())?;
            pins.insert(handle_id, pin);
        }
        metrics::kv_pins(&self.worker_id, 1);
        let (pins, engine, worker_id) = (self.pins.clone(), self.engine.clone(), self.worker_id.clone());
        tokio::spawn(async move {
            tokio::time::sleep(lease).await;
            let expired = pins.lock().remove(&handle_id);
            if let Some(pin) = expired {
                engine.unpin(pin.revoke());
                metrics::kv_pins(&worker_id, -1);
                metrics::kv_lease_expired(&worker_id);
                tracing::debug!(handle_id, "a prefill's lease expired before its decode worker released it");
            }
        });
        Ok(())
    }

    /// Unpins a handle; false if it was unknown (released or expired) or
    /// `handle`'s token is not its own (then nothing is released).
    pub fn release(&self, handle: HandleKey) -> bool {
        let pin = {
            let mut pins = self.pins.lock();
            match pinned(&pins, handle, RELEASE) {
                Ok(_) => pins.remove(&handle.id),
                Err(_) => None,
            }
        };
        match pin {
            Some(pin) => {
                self.engine.unpin(pin.revoke());
                metrics::kv_pins(&self.worker_id, -1);
                true
            }
            None => false,
        }
    }

    /// Blocks of a handle.
    pub fn block_count(&self, handle: HandleKey) -> Result<usize, WorkerError> {
        Ok(pinned(&self.pins.lock(), handle, READ_BLOCKS)?.blocks.len())
    }

    /// Copies block `index` of a handle.
    pub fn copy_block(&self, handle: HandleKey, index: usize) -> Result<Vec<u8>, WorkerError> {
        let memory = self.memory.as_ref().ok_or_else(|| WorkerError::NotFound("this worker holds no KV blocks for others".into()))?;
        let pins = self.pins.lock();
        let pin = pinned(&pins, handle, READ_BLOCKS)?;
        let &block =
            pin.blocks.get(index).ok_or_else(|| WorkerError::InvalidArgument(format!("the handle has {} blocks, not {}", pin.blocks.len(), index + 1)))?;
        // SAFETY: pinned while the table lock is held (a release removes
        // the pin under this lock before unpinning).
        #[allow(unsafe_code)]
        let bytes = unsafe { memory.with_block(block, &mut Vec::new(), <[u8]>::to_vec) };
        bytes.map_err(|error| WorkerError::Internal(format!("reading KV block {index} off the device: {error}")))
    }

    /// What `Describe` answers: the pool's key, or (keyed per handle) the
    /// keys of this handle's runs only.
    pub fn describe(&self, handle: HandleKey) -> Result<Described, WorkerError> {
        let memory = self.memory.as_ref().ok_or_else(|| WorkerError::NotFound("this worker holds no KV blocks for others".into()))?;
        let pins = self.pins.lock();
        let pin = pinned(&pins, handle, DESCRIBE)?;
        #[cfg(feature = "ucx")]
        let ucx = match (self.ucx.as_ref().and_then(|agent| agent.region()), &pin.exposed) {
            (Some(region), Some(keys)) => Some(UcxRegion { range_keys: keys.exposed.range_keys().to_vec(), ..region.clone() }),
            (Some(region), None) if !region.remote_key.is_empty() => Some(region.clone()),
            // Keyed per handle and this handle's registration failed.
            _ => None,
        };
        #[cfg(not(feature = "ucx"))]
        let ucx = {
            let _ = pin;
            None
        };
        Ok(Described { layout: memory.layout().clone(), ucx, memory_id: self.memory_id })
    }
}

const DESCRIBE: &str = "/turbine.worker.v1.KvTransfer/Describe";
const READ_BLOCKS: &str = "/turbine.worker.v1.KvTransfer/ReadBlocks";
const RELEASE: &str = "/turbine.worker.v1.KvTransfer/Release";

/// The pin `handle` names, if its token is the pin's. A wrong token reads
/// as an unknown handle (a caller cannot tell a live id from a dead one)
/// and is counted against `method` as a refused capability, a strike
/// against the caller's connection.
fn pinned<'a>(pins: &'a HashMap<u64, Pin>, handle: HandleKey, method: &str) -> Result<&'a Pin, WorkerError> {
    match pins.get(&handle.id) {
        Some(pin) if pin.token.matches(&handle.token) => Ok(pin),
        Some(_) => {
            turbine_runtime::trust::refuse(crate::serve::ROLES, method, Refusal::BadCapability);
            tracing::warn!(handle_id = handle.id, method, "a KvTransfer call named a live handle with another token: refused as unknown");
            Err(unknown_handle(handle.id))
        }
        None => Err(unknown_handle(handle.id)),
    }
}

/// A handle's blocks registered with UCX for it alone, counted in
/// `turbine_worker_kv_ucx_handle_keys` until dropped (unregistered).
#[cfg(feature = "ucx")]
pub(super) struct HandleKeys {
    exposed: turbine_ucx_agent::Exposed,
    worker_id: WorkerId,
    runs: i64,
}

#[cfg(feature = "ucx")]
impl std::fmt::Debug for HandleKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandleKeys").field("runs", &self.runs).finish()
    }
}

#[cfg(feature = "ucx")]
impl HandleKeys {
    fn new(exposed: turbine_ucx_agent::Exposed, worker_id: &WorkerId) -> Self {
        let runs = exposed.range_keys().len() as i64;
        metrics::kv_ucx_handle_keys(worker_id, runs);
        Self { exposed, worker_id: worker_id.clone(), runs }
    }
}

#[cfg(feature = "ucx")]
impl Drop for HandleKeys {
    fn drop(&mut self) {
        metrics::kv_ucx_handle_keys(&self.worker_id, -self.runs);
    }
}

fn unknown_handle(handle_id: u64) -> WorkerError {
    WorkerError::NotFound(format!("no KV handle {handle_id} (released or expired)"))
}

/// The worker's own KvTransfer, for a client in the same process.
#[tonic::async_trait]
impl KvTransferApi for Disagg {
    async fn describe(&self, handle: HandleKey) -> Result<Described, WorkerError> {
        Disagg::describe(self, handle)
    }

    async fn read_blocks(&self, handle: HandleKey, indices: &[usize], block_bytes: usize, mut into: Vec<u8>) -> Result<Vec<u8>, WorkerError> {
        into.clear();
        for &index in indices {
            let block = self.copy_block(handle, index)?;
            if block.len() != block_bytes {
                return Err(WorkerError::InvalidArgument(format!("blocks are {} bytes, not {block_bytes}", block.len())));
            }
            into.extend_from_slice(&block);
        }
        Ok(into)
    }

    async fn release(&self, handle: HandleKey) -> Result<bool, WorkerError> {
        Ok(Disagg::release(self, handle))
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
