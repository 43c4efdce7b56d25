//! Raw bindings to UCX's UCP API (libucp, libucs), as installed by Debian's
//! `libucx-dev` 1.13. Safe use goes through `turbine-ucx`.
//!
//! `bindings.rs` is generated, not written: regenerate it after a UCX
//! upgrade with
//!
//! ```text
//! echo '#include <ucp/api/ucp.h>' > /tmp/ucx.h
//! bindgen /tmp/ucx.h --allowlist-function '^(ucp|ucs)_.*' --allowlist-type '^(ucp|ucs)_.*' \
//!   --allowlist-var '^(UCP|UCS)_.*' --no-layout-tests --default-enum-style moduleconsts \
//!   --no-doc-comments --use-core -o crates/ucx-sys/src/bindings.rs
//! ```
//!
//! The header's inline helpers are re-implemented below.

#![allow(unsafe_code, non_camel_case_types, non_snake_case, non_upper_case_globals, missing_docs, clippy::all)]

include!("bindings.rs");

/// `ucp_init` (an inline function in `ucp.h`): `ucp_init_version` with the
/// API version these bindings were generated for.
///
/// # Safety
/// As `ucp_init_version`: valid parameter pointers.
pub unsafe fn ucp_init(params: *const ucp_params_t, config: *const ucp_config_t, context_p: *mut ucp_context_h) -> ucs_status_t::Type {
    unsafe { ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, params, config, context_p) }
}

/// `UCS_PTR_IS_ERR`: the pointer encodes an error status.
pub fn ucs_ptr_is_err(ptr: ucs_status_ptr_t) -> bool {
    (ptr as usize) >= (ucs_status_t::UCS_ERR_LAST as isize as usize)
}

/// `UCS_PTR_IS_PTR`: the pointer is a request (neither NULL nor an error).
pub fn ucs_ptr_is_ptr(ptr: ucs_status_ptr_t) -> bool {
    (ptr as usize).wrapping_sub(1) < (ucs_status_t::UCS_ERR_LAST as isize as usize).wrapping_sub(1)
}

/// `UCS_PTR_STATUS`: the status a non-request pointer encodes.
pub fn ucs_ptr_status(ptr: ucs_status_ptr_t) -> ucs_status_t::Type {
    ptr as isize as ucs_status_t::Type
}
