//! Connections to peer workers, their unpacked remote keys and the reads in flight.

use std::marker::PhantomData;
use std::ptr;

use turbine_ucx_sys as sys;

use crate::error::check;
use crate::{UcxError, Worker};

/// A connection to a peer worker.
pub struct Endpoint<'w> {
    pub(crate) handle: sys::ucp_ep_h,
    pub(crate) worker: &'w Worker,
}

impl std::fmt::Debug for Endpoint<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint").finish_non_exhaustive()
    }
}

impl<'w> Endpoint<'w> {
    /// Unpacks a peer's [`MemoryRegion::packed_rkey`](crate::MemoryRegion::packed_rkey) for reads through
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
            return Err(UcxError {
                call: "ucp_get_nbx",
                status: i32::from(sys::ucs_status_t::UCS_ERR_INVALID_PARAM),
                message: "the remote key was unpacked for another endpoint".into(),
            });
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
    pub(crate) handle: *mut std::ffi::c_void,
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
    pub(crate) fn poll(&mut self) -> Option<Result<(), UcxError>> {
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
