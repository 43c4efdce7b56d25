//! One-sided reads over UCX (the KV transfer data path).
//!
//! The owner of some memory registers it ([`MemoryRegion`]) and hands the
//! reader three things over the control path: its worker's address
//! ([`Worker::address`]), the region's packed remote key
//! ([`MemoryRegion::packed_rkey`]) and the region's base address. The reader
//! connects an [`Endpoint`] to that worker address, unpacks the key
//! ([`Endpoint::remote_key`]) and posts reads ([`Endpoint::get`]), then
//! drives its worker until they complete ([`Worker::wait_all`]). The owner's
//! CPU takes no part in the reads (GPUDirect-capable transports read device
//! memory the same way).
//!
//! Threading: a [`Worker`] and everything made from it belong to one thread
//! at a time (UCX's single-thread mode); the types are `Send`, not `Sync`.

#![allow(unsafe_code)]

use std::ffi::CStr;
use std::marker::PhantomData;
use std::ptr;
use std::sync::Arc;

use turbine_ucx_sys as sys;

/// Why [`Worker::wait_all_until`] gave up.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum WaitError {
    /// A request failed or timed out and was cancelled; UCX let go of
    /// every buffer.
    #[error(transparent)]
    Failed(#[from] UcxError),
    /// Requests timed out and did not complete even when cancelled (a
    /// peer gone on a transport without error handling): their buffers
    /// must be leaked.
    #[error("UCX requests timed out and could not be cancelled")]
    Abandoned,
}

/// A UCX call failed.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("UCX {call}: {message} ({status})")]
pub struct UcxError {
    /// The function that failed.
    pub call: &'static str,
    /// UCX's status code.
    pub status: i32,
    /// UCX's description.
    pub message: String,
}

fn check(call: &'static str, status: sys::ucs_status_t::Type) -> Result<(), UcxError> {
    if status == sys::ucs_status_t::UCS_OK {
        return Ok(());
    }
    // SAFETY: ucs_status_string returns a static string for any status.
    let message = unsafe { CStr::from_ptr(sys::ucs_status_string(status)) }.to_string_lossy().into_owned();
    Err(UcxError { call, status: i32::from(status), message })
}

struct ContextHandle(sys::ucp_context_h);

// SAFETY: a UCP context may be used from any thread (workers carry the
// thread affinity); it is only destroyed when the last reference goes.
unsafe impl Send for ContextHandle {}
unsafe impl Sync for ContextHandle {}

impl Drop for ContextHandle {
    fn drop(&mut self) {
        // SAFETY: created by ucp_init; every worker and registration holds
        // an Arc to it, so none outlives it.
        unsafe { sys::ucp_cleanup(self.0) };
    }
}

/// A UCP context with remote memory access enabled.
#[derive(Clone)]
pub struct Context {
    handle: Arc<ContextHandle>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").finish_non_exhaustive()
    }
}

impl Context {
    /// Initializes UCX with the RMA feature (transports from the usual
    /// `UCX_*` environment variables, e.g. `UCX_TLS=tcp`).
    pub fn new() -> Result<Self, UcxError> {
        Self::with_features(sys::ucp_feature::UCP_FEATURE_RMA as u64)
    }

    /// Initializes UCX with RMA and wakeup: a thread can sleep in
    /// [`Worker::wait`] until the network or a [`Waker`] needs it.
    pub fn with_wakeup() -> Result<Self, UcxError> {
        Self::with_features((sys::ucp_feature::UCP_FEATURE_RMA | sys::ucp_feature::UCP_FEATURE_WAKEUP) as u64)
    }

    /// Initializes UCX with RMA and wakeup over only the transports in
    /// `tls` (UCX's `UCX_TLS` syntax, e.g. `"sm,self"`), whatever the
    /// environment says.
    pub fn with_transports(tls: &str) -> Result<Self, UcxError> {
        let tls = std::ffi::CString::new(tls).map_err(|_| UcxError { call: "ucp_config_modify", status: -5, message: "NUL in transport list".into() })?;
        // SAFETY: the config is read, modified and released here; the
        // strings outlive the calls.
        unsafe {
            let mut config = ptr::null_mut();
            check("ucp_config_read", sys::ucp_config_read(ptr::null(), ptr::null(), &mut config))?;
            let modified = check("ucp_config_modify", sys::ucp_config_modify(config, c"TLS".as_ptr(), tls.as_ptr()));
            let features = (sys::ucp_feature::UCP_FEATURE_RMA | sys::ucp_feature::UCP_FEATURE_WAKEUP) as u64;
            let context = modified.and_then(|()| Self::init(features, config));
            sys::ucp_config_release(config);
            context
        }
    }

    /// Whether this UCX can register and move CUDA device memory (it was
    /// built with CUDA support and found a driver).
    pub fn supports_cuda(&self) -> bool {
        // SAFETY: a live context; zeroed attributes with one field asked.
        unsafe {
            let mut attr: sys::ucp_context_attr_t = std::mem::zeroed();
            attr.field_mask = sys::ucp_context_attr_field::UCP_ATTR_FIELD_MEMORY_TYPES as u64;
            sys::ucp_context_query(self.handle.0, &mut attr) == sys::ucs_status_t::UCS_OK
                && attr.memory_types & (1u64 << sys::ucs_memory_type::UCS_MEMORY_TYPE_CUDA) != 0
        }
    }

    fn with_features(features: u64) -> Result<Self, UcxError> {
        // SAFETY: no config: UCX reads the environment.
        unsafe { Self::init(features, ptr::null()) }
    }

    /// # Safety
    /// `config` is null or a live config.
    unsafe fn init(features: u64, config: *const sys::ucp_config_t) -> Result<Self, UcxError> {
        // SAFETY: zeroed params with only the features field set, as UCX
        // documents; the out-pointer is valid; config per the caller.
        unsafe {
            let mut params: sys::ucp_params_t = std::mem::zeroed();
            params.field_mask = sys::ucp_params_field::UCP_PARAM_FIELD_FEATURES as u64;
            params.features = features;
            let mut context = ptr::null_mut();
            check("ucp_init", sys::ucp_init(&params, config, &mut context))?;
            Ok(Self { handle: Arc::new(ContextHandle(context)) })
        }
    }
}

/// A progress engine and its network address.
pub struct Worker {
    handle: sys::ucp_worker_h,
    /// The handle as wakers see it: cleared (under its lock) before the
    /// worker is destroyed.
    wakers: Arc<parking_lot::Mutex<Option<WorkerPtr>>>,
    /// Held so the context outlives the worker.
    _context: Context,
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

// SAFETY: single-thread mode means one thread at a time, which `Send`
// without `Sync` guarantees.
unsafe impl Send for Worker {}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").finish_non_exhaustive()
    }
}

impl Worker {
    /// A worker of `context` in single-thread mode.
    pub fn new(context: &Context) -> Result<Self, UcxError> {
        // SAFETY: zeroed params with the thread mode set; valid out-pointer.
        unsafe {
            let mut params: sys::ucp_worker_params_t = std::mem::zeroed();
            params.field_mask = sys::ucp_worker_params_field::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64;
            params.thread_mode = sys::ucs_thread_mode_t::UCS_THREAD_MODE_SINGLE;
            let mut worker = ptr::null_mut();
            check("ucp_worker_create", sys::ucp_worker_create(context.handle.0, &params, &mut worker))?;
            let wakers = Arc::new(parking_lot::Mutex::new(Some(WorkerPtr(worker))));
            Ok(Self { handle: worker, wakers, _context: context.clone(), _not_sync: PhantomData })
        }
    }

    /// This worker's address, for a peer's [`Endpoint`] (opaque bytes).
    pub fn address(&self) -> Result<Vec<u8>, UcxError> {
        // SAFETY: UCX allocates the address; it is copied, then released.
        unsafe {
            let mut address = ptr::null_mut();
            let mut length = 0usize;
            check("ucp_worker_get_address", sys::ucp_worker_get_address(self.handle, &mut address, &mut length))?;
            let bytes = std::slice::from_raw_parts(address as *const u8, length).to_vec();
            sys::ucp_worker_release_address(self.handle, address);
            Ok(bytes)
        }
    }

    /// Makes progress on outstanding operations; true if any advanced.
    pub fn progress(&self) -> bool {
        // SAFETY: a live worker, used from its one thread.
        unsafe { sys::ucp_worker_progress(self.handle) != 0 }
    }

    /// Drives this worker until every request in `requests` completes;
    /// returns the first failure (all are completed or freed either way).
    pub fn wait_all(&self, requests: Vec<Request<'_>>) -> Result<(), UcxError> {
        let mut first_error = None;
        for request in requests {
            if let Err(error) = request.wait(self) {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Drives this worker until every request completes or `deadline`
    /// passes; then the rest are cancelled and driven for up to `grace`
    /// more. Requests that still have not let go are abandoned.
    ///
    /// # Safety
    /// On [`WaitError::Abandoned`], UCX may still write into the abandoned
    /// requests' buffers at any later time: the caller must never free or
    /// reuse them (leak them).
    pub unsafe fn wait_all_until(&self, requests: Vec<Request<'_>>, deadline: std::time::Instant, grace: std::time::Duration) -> Result<(), WaitError> {
        let mut pending: Vec<Request<'_>> = requests.into_iter().filter(|request| !request.is_done()).collect();
        let mut first_error = None;
        let mut cancelled_at = None;
        while !pending.is_empty() {
            self.progress();
            pending.retain_mut(|request| match request.poll() {
                None => true,
                Some(result) => {
                    if let Err(error) = result {
                        first_error.get_or_insert(error);
                    }
                    false
                }
            });
            let now = std::time::Instant::now();
            match cancelled_at {
                None if !pending.is_empty() && now >= deadline => {
                    for request in &pending {
                        // SAFETY: a live request of this worker.
                        unsafe { sys::ucp_request_cancel(self.handle, request.handle) };
                    }
                    cancelled_at = Some(now);
                }
                Some(at) if !pending.is_empty() && now >= at + grace => {
                    // Dropping a request still in flight only releases our
                    // reference; its buffer is the caller's to leak.
                    drop(pending);
                    return Err(WaitError::Abandoned);
                }
                _ => {}
            }
        }
        if cancelled_at.is_some() {
            return Err(WaitError::Failed(UcxError { call: "wait", status: i32::from(sys::ucs_status_t::UCS_ERR_TIMED_OUT), message: "timed out".into() }));
        }
        first_error.map_or(Ok(()), |error| Err(WaitError::Failed(error)))
    }

    /// Arms the worker's wakeup: `Ok(true)` when armed (nothing pending;
    /// [`wait`](Self::wait) may sleep), `Ok(false)` when events arrived
    /// meanwhile (progress again first). Needs [`Context::with_wakeup`].
    pub fn arm(&self) -> Result<bool, UcxError> {
        // SAFETY: a live worker, used from its one thread.
        let status = unsafe { sys::ucp_worker_arm(self.handle) };
        if status == sys::ucs_status_t::UCS_ERR_BUSY {
            return Ok(false);
        }
        check("ucp_worker_arm", status).map(|()| true)
    }

    /// A file descriptor that becomes readable when the armed worker has
    /// events (to wait on several workers with `poll`). Needs wakeup.
    pub fn event_fd(&self) -> Result<std::os::fd::RawFd, UcxError> {
        let mut fd = -1;
        // SAFETY: a live worker; valid out-pointer.
        check("ucp_worker_get_efd", unsafe { sys::ucp_worker_get_efd(self.handle, &mut fd) })?;
        Ok(fd)
    }

    /// Sleeps until the network needs this worker or a [`Waker`] wakes it.
    pub fn wait(&self) -> Result<(), UcxError> {
        // SAFETY: a live worker, used from its one thread.
        check("ucp_worker_wait", unsafe { sys::ucp_worker_wait(self.handle) })
    }

    /// A handle other threads use to interrupt [`wait`](Self::wait).
    pub fn waker(&self) -> Waker {
        Waker { worker: self.wakers.clone() }
    }

    /// An endpoint to the worker whose [`address`](Self::address) is `peer`.
    /// With `peer_errors`, a failure of the peer fails the endpoint's
    /// requests instead of hanging them (UCX's peer error handling); UCX's
    /// shared-memory transports do not support it, so endpoints of a
    /// shared-memory-only context connect without.
    pub fn connect(&self, peer: &[u8], peer_errors: bool) -> Result<Endpoint<'_>, UcxError> {
        // SAFETY: the address bytes stay alive during the call; zeroed
        // params with the remote address and error handling set.
        unsafe {
            let mut params: sys::ucp_ep_params_t = std::mem::zeroed();
            params.field_mask = (sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE) as u64;
            params.err_mode = if peer_errors {
                sys::ucp_err_handling_mode_t::UCP_ERR_HANDLING_MODE_PEER
            } else {
                sys::ucp_err_handling_mode_t::UCP_ERR_HANDLING_MODE_NONE
            };
            params.address = peer.as_ptr() as *const sys::ucp_address_t;
            let mut endpoint = ptr::null_mut();
            check("ucp_ep_create", sys::ucp_ep_create(self.handle, &params, &mut endpoint))?;
            Ok(Endpoint { handle: endpoint, worker: self })
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // No waker signals from here on.
        let mut wakers = self.wakers.lock();
        *wakers = None;
        // SAFETY: endpoints borrow the worker, so none is left; the context
        // field is dropped after this, so it outlives the worker; wakers
        // are locked out.
        unsafe { sys::ucp_worker_destroy(self.handle) };
    }
}

#[derive(Clone, Copy)]
struct WorkerPtr(sys::ucp_worker_h);

// SAFETY: only ucp_worker_signal is called through it, which UCX allows
// from any thread, and only while the worker lives (see `Waker`).
unsafe impl Send for WorkerPtr {}

/// Wakes a [`Worker`] sleeping in [`Worker::wait`], from any thread.
#[derive(Clone)]
pub struct Waker {
    worker: Arc<parking_lot::Mutex<Option<WorkerPtr>>>,
}

impl std::fmt::Debug for Waker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waker").finish_non_exhaustive()
    }
}

impl Waker {
    /// Interrupts the worker's wait (a no-op once the worker is gone).
    pub fn wake(&self) {
        let worker = self.worker.lock();
        if let Some(WorkerPtr(handle)) = *worker {
            // SAFETY: the worker lives while its pointer is set (it is
            // cleared under this lock before destruction); signalling is
            // thread-safe.
            unsafe { sys::ucp_worker_signal(handle) };
        }
    }
}

/// Memory registered for remote reads.
pub struct MemoryRegion {
    handle: sys::ucp_mem_h,
    context: Context,
    address: u64,
    length: usize,
}

// SAFETY: a registration is a context-level object, usable from any thread.
unsafe impl Send for MemoryRegion {}
unsafe impl Sync for MemoryRegion {}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion").field("address", &self.address).field("length", &self.length).finish()
    }
}

impl MemoryRegion {
    /// Registers `length` bytes at `address` with `context`.
    ///
    /// # Safety
    /// The memory must stay allocated (and at the same place) until the
    /// region is dropped; peers may read it at any time meanwhile.
    pub unsafe fn register(context: &Context, address: *mut u8, length: usize) -> Result<Self, UcxError> {
        // SAFETY: per the caller's promise.
        unsafe { Self::map_existing(context, address as u64, length, None) }
    }

    /// `ucp_mem_map` of memory someone else allocated, of `memory_type`
    /// (`None`: UCX detects it).
    ///
    /// # Safety
    /// As [`register`](Self::register).
    unsafe fn map_existing(context: &Context, address: u64, length: usize, memory_type: Option<sys::ucs_memory_type::Type>) -> Result<Self, UcxError> {
        // SAFETY: per the caller's promise; zeroed params with address,
        // length and (when given) the memory type set.
        unsafe {
            let mut params: sys::ucp_mem_map_params_t = std::mem::zeroed();
            params.field_mask =
                (sys::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_LENGTH) as u64;
            params.address = address as *mut _;
            params.length = length;
            if let Some(memory_type) = memory_type {
                params.field_mask |= sys::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE as u64;
                params.memory_type = memory_type;
            }
            let mut memh = ptr::null_mut();
            check("ucp_mem_map", sys::ucp_mem_map(context.handle.0, &params, &mut memh))?;
            Ok(Self { handle: memh, context: context.clone(), address, length })
        }
    }

    /// Registers `length` bytes of CUDA device memory at `address` with
    /// `context`, so that peers read GPU memory directly (GPUDirect RDMA,
    /// CUDA IPC on one machine) where UCX was built with CUDA support; a
    /// UCX without it refuses the registration.
    ///
    /// # Safety
    /// The device memory must stay allocated until the region is dropped;
    /// peers may read it at any time meanwhile.
    pub unsafe fn register_cuda(context: &Context, address: u64, length: usize) -> Result<Self, UcxError> {
        // A UCX without CUDA would register the address as host memory,
        // and serving a read would then touch device memory from the CPU.
        if !context.supports_cuda() {
            return Err(UcxError {
                call: "ucp_mem_map",
                status: i32::from(sys::ucs_status_t::UCS_ERR_UNSUPPORTED),
                message: "this UCX has no CUDA support (built without it, or no CUDA driver)".into(),
            });
        }
        // SAFETY: per the caller's promise.
        unsafe { Self::map_existing(context, address, length, Some(sys::ucs_memory_type::UCS_MEMORY_TYPE_CUDA)) }
    }

    /// Allocates `length` bytes through UCX and registers them with
    /// `context`. UCX tries its allocators in `UCX_ALLOC_PRIO` order; on
    /// one machine the shared-memory ones come first, and memory they hand
    /// out is what peers on the same machine can map and read without the
    /// owner's help ([`RemoteKey::local_ptr`]). The memory is zeroed by the
    /// kernel or by UCX; it lives until the region is dropped.
    pub fn allocate(context: &Context, length: usize) -> Result<Self, UcxError> {
        // SAFETY: zeroed params with length and the ALLOCATE flag; the
        // address UCX chose is read back from the mapping it returned.
        unsafe {
            let mut params: sys::ucp_mem_map_params_t = std::mem::zeroed();
            params.field_mask = (sys::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_FLAGS) as u64;
            params.address = ptr::null_mut();
            params.length = length;
            params.flags = sys::_bindgen_ty_4::UCP_MEM_MAP_ALLOCATE;
            let mut memh = ptr::null_mut();
            check("ucp_mem_map", sys::ucp_mem_map(context.handle.0, &params, &mut memh))?;
            let mut attr: sys::ucp_mem_attr_t = std::mem::zeroed();
            attr.field_mask = (sys::ucp_mem_attr_field::UCP_MEM_ATTR_FIELD_ADDRESS | sys::ucp_mem_attr_field::UCP_MEM_ATTR_FIELD_LENGTH) as u64;
            if let Err(error) = check("ucp_mem_query", sys::ucp_mem_query(memh, &mut attr)) {
                sys::ucp_mem_unmap(context.handle.0, memh);
                return Err(error);
            }
            Ok(Self { handle: memh, context: context.clone(), address: attr.address as u64, length: attr.length.min(length) })
        }
    }

    /// The first byte of the region in this process.
    pub fn as_ptr(&self) -> *mut u8 {
        self.address as *mut u8
    }

    /// The base address peers read at (plus an offset).
    pub fn address(&self) -> u64 {
        self.address
    }

    /// Registered bytes.
    pub fn len(&self) -> usize {
        self.length
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.length == 0
    }

    /// The remote key a peer needs to read this region (opaque bytes).
    pub fn packed_rkey(&self) -> Result<Vec<u8>, UcxError> {
        // SAFETY: UCX allocates the buffer; it is copied, then released.
        unsafe {
            let mut buffer = ptr::null_mut();
            let mut size = 0usize;
            check("ucp_rkey_pack", sys::ucp_rkey_pack(self.context.handle.0, self.handle, &mut buffer, &mut size))?;
            let bytes = std::slice::from_raw_parts(buffer as *const u8, size).to_vec();
            sys::ucp_rkey_buffer_release(buffer);
            Ok(bytes)
        }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: mapped by ucp_mem_map on this context.
        unsafe { sys::ucp_mem_unmap(self.context.handle.0, self.handle) };
    }
}

/// A connection to a peer worker.
pub struct Endpoint<'w> {
    handle: sys::ucp_ep_h,
    worker: &'w Worker,
}

impl std::fmt::Debug for Endpoint<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint").finish_non_exhaustive()
    }
}

impl<'w> Endpoint<'w> {
    /// Unpacks a peer's [`MemoryRegion::packed_rkey`] for reads through
    /// this endpoint. The key may outlive the endpoint (not its worker):
    /// keep it to keep a shared-memory mapping ([`RemoteKey::local_ptr`]);
    /// gets with it through another endpoint are refused.
    pub fn remote_key(&self, packed: &[u8]) -> Result<RemoteKey<'w>, UcxError> {
        // SAFETY: the buffer is alive during the call; valid out-pointer.
        unsafe {
            let mut rkey = ptr::null_mut();
            check("ucp_ep_rkey_unpack", sys::ucp_ep_rkey_unpack(self.handle, packed.as_ptr() as *const _, &mut rkey))?;
            Ok(RemoteKey { handle: rkey, endpoint: self.handle, _worker: PhantomData })
        }
    }

    /// Posts a read of `into.len()` bytes at the peer's `remote_address`
    /// into `into`. The read may complete at once (`Request` is then done)
    /// or later: drive the worker until it does.
    pub fn get<'a>(&'a self, into: &'a mut [u8], remote_address: u64, key: &'a RemoteKey<'_>) -> Result<Request<'a>, UcxError> {
        if key.endpoint != self.handle {
            return Err(UcxError { call: "ucp_get_nbx", status: i32::from(sys::ucs_status_t::UCS_ERR_INVALID_PARAM), message: "the remote key was unpacked for another endpoint".into() });
        }
        // SAFETY: `into` is borrowed for the request's lifetime, so the
        // buffer outlives the read; zeroed params mean no callback.
        unsafe {
            let params: sys::ucp_request_param_t = std::mem::zeroed();
            let status = sys::ucp_get_nbx(self.handle, into.as_mut_ptr() as *mut _, into.len(), remote_address, key.handle, &params);
            Request::from_status("ucp_get_nbx", status)
        }
    }

    /// The worker this endpoint belongs to.
    pub fn worker(&self) -> &'w Worker {
        self.worker
    }
}

impl Drop for Endpoint<'_> {
    fn drop(&mut self) {
        // SAFETY: a forced close completes locally (a flushing close would
        // wait for the peer, which may be gone or not progressing).
        unsafe {
            let mut params: sys::ucp_request_param_t = std::mem::zeroed();
            params.op_attr_mask = sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_FLAGS;
            params.flags = sys::ucp_ep_close_flags_t::UCP_EP_CLOSE_FLAG_FORCE;
            let status = sys::ucp_ep_close_nbx(self.handle, &params);
            if let Ok(request) = Request::from_status("ucp_ep_close_nbx", status) {
                let _ = request.wait(self.worker);
            }
        }
    }
}

/// A peer region's key, unpacked for one endpoint of worker `'w`.
pub struct RemoteKey<'w> {
    handle: sys::ucp_rkey_h,
    endpoint: sys::ucp_ep_h,
    _worker: PhantomData<&'w Worker>,
}

impl std::fmt::Debug for RemoteKey<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteKey").finish_non_exhaustive()
    }
}

impl RemoteKey<'_> {
    /// Where the peer's byte at `remote_address` is mapped in this process,
    /// when the peer's memory is shared with it (same machine, memory UCX
    /// allocated in shared memory); `None` otherwise, and reads must go
    /// through [`Endpoint::get`].
    ///
    /// Reading through the pointer needs nothing from the peer, not even
    /// its progress; the mapping lives as long as this key.
    pub fn local_ptr(&self, remote_address: u64) -> Option<*const u8> {
        let mut local = ptr::null_mut();
        // SAFETY: a live key; valid out-pointer.
        let status = unsafe { sys::ucp_rkey_ptr(self.handle, remote_address, &mut local) };
        (status == sys::ucs_status_t::UCS_OK && !local.is_null()).then_some(local as *const u8)
    }
}

impl Drop for RemoteKey<'_> {
    fn drop(&mut self) {
        // SAFETY: unpacked by ucp_ep_rkey_unpack.
        unsafe { sys::ucp_rkey_destroy(self.handle) };
    }
}

/// An operation in flight (or already done).
#[must_use = "a request must be waited for"]
pub struct Request<'a> {
    /// Null when it completed at once.
    handle: *mut std::ffi::c_void,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl std::fmt::Debug for Request<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request").field("done", &self.handle.is_null()).finish()
    }
}

impl Request<'_> {
    fn from_status(call: &'static str, status: sys::ucs_status_ptr_t) -> Result<Self, UcxError> {
        if status.is_null() {
            return Ok(Self { handle: ptr::null_mut(), _borrow: PhantomData });
        }
        if sys::ucs_ptr_is_err(status) {
            check(call, sys::ucs_ptr_status(status))?;
        }
        Ok(Self { handle: status, _borrow: PhantomData })
    }

    /// Whether it completed when posted.
    pub fn is_done(&self) -> bool {
        self.handle.is_null()
    }

    /// The result once the request completed (it is then freed), `None`
    /// while in progress.
    fn poll(&mut self) -> Option<Result<(), UcxError>> {
        if self.handle.is_null() {
            return Some(Ok(()));
        }
        // SAFETY: a live request.
        let status = unsafe { sys::ucp_request_check_status(self.handle) };
        if status == sys::ucs_status_t::UCS_INPROGRESS {
            return None;
        }
        // SAFETY: completed; freed once (handle cleared).
        unsafe { sys::ucp_request_free(self.handle) };
        self.handle = ptr::null_mut();
        Some(check("request", status))
    }

    /// Drives `worker` until the request completes.
    pub fn wait(mut self, worker: &Worker) -> Result<(), UcxError> {
        if self.handle.is_null() {
            return Ok(());
        }
        loop {
            // SAFETY: a live request of this worker.
            let status = unsafe { sys::ucp_request_check_status(self.handle) };
            if status != sys::ucs_status_t::UCS_INPROGRESS {
                // SAFETY: completed; freed once (handle cleared).
                unsafe { sys::ucp_request_free(self.handle) };
                self.handle = ptr::null_mut();
                return check("request", status);
            }
            worker.progress();
        }
    }
}

impl Drop for Request<'_> {
    fn drop(&mut self) {
        if !self.handle.is_null() {
            // An unwaited request: UCX completes it on its own; release
            // our reference so it is freed then.
            // SAFETY: a live request, freed once.
            unsafe { sys::ucp_request_free(self.handle) };
        }
    }
}
