//! The progress engine ([`Worker`]) and what wakes it from another thread ([`Waker`]).

use std::marker::PhantomData;
use std::ptr;
use std::sync::Arc;

use turbine_ucx_sys as sys;

use crate::endpoint::Endpoint;
use crate::error::check;
use crate::{Context, Request, UcxError, WaitError};

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
            params.field_mask =
                (sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE) as u64;
            params.err_mode =
                if peer_errors { sys::ucp_err_handling_mode_t::UCP_ERR_HANDLING_MODE_PEER } else { sys::ucp_err_handling_mode_t::UCP_ERR_HANDLING_MODE_NONE };
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
