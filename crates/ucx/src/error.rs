//! What a failed UCX call or wait reports.

use std::ffi::CStr;

use turbine_ucx_sys as sys;

/// Why [`Worker::wait_all_until`](crate::Worker::wait_all_until) gave up.
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

pub(crate) fn check(call: &'static str, status: sys::ucs_status_t::Type) -> Result<(), UcxError> {
    if status == sys::ucs_status_t::UCS_OK {
        return Ok(());
    }
    // SAFETY: ucs_status_string returns a static string for any status.
    let message = unsafe { CStr::from_ptr(sys::ucs_status_string(status)) }.to_string_lossy().into_owned();
    Err(UcxError { call, status: i32::from(status), message })
}
