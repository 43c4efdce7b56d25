//! The UCX context: the process-wide transport set.

use std::ptr;
use std::sync::Arc;

use turbine_ucx_sys as sys;

use crate::UcxError;
use crate::error::check;

pub(crate) struct ContextHandle(pub(crate) sys::ucp_context_h);

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
    pub(crate) handle: Arc<ContextHandle>,
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
    /// [`Worker::wait`](crate::Worker::wait) until the network or a [`Waker`](crate::Waker) needs it.
    pub fn with_wakeup() -> Result<Self, UcxError> {
        Self::with_features((sys::ucp_feature::UCP_FEATURE_RMA | sys::ucp_feature::UCP_FEATURE_WAKEUP) as u64)
    }

    /// Initializes UCX with RMA and wakeup over only the transports in
    /// `tls` (UCX's `UCX_TLS` syntax, e.g. `"sm,self"`), whatever the
    /// environment says.
    pub fn with_transports(tls: &str) -> Result<Self, UcxError> {
        Self::with_settings(&[("TLS", tls)])
    }

    /// Initializes UCX with RMA and wakeup, its configuration read from
    /// the environment and then each `(name, value)` of `settings` set
    /// (names without the `UCX_` prefix: `("NET_DEVICES", "eth1")`).
    pub fn with_settings(settings: &[(&str, &str)]) -> Result<Self, UcxError> {
        let bad = |_| UcxError { call: "ucp_config_modify", status: -5, message: "NUL in a UCX setting".into() };
        let settings: Vec<(std::ffi::CString, std::ffi::CString)> = settings
            .iter()
            .map(|(name, value)| Ok((std::ffi::CString::new(*name).map_err(bad)?, std::ffi::CString::new(*value).map_err(bad)?)))
            .collect::<Result<_, UcxError>>()?;
        // SAFETY: the config is read, modified and released here; the
        // strings outlive the calls.
        unsafe {
            let mut config = ptr::null_mut();
            check("ucp_config_read", sys::ucp_config_read(ptr::null(), ptr::null(), &mut config))?;
            let modified =
                settings.iter().try_for_each(|(name, value)| check("ucp_config_modify", sys::ucp_config_modify(config, name.as_ptr(), value.as_ptr())));
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
        // SAFETY: zeroed params with the features and the shared-workers
        // fields set, as UCX documents; the out-pointer is valid; config
        // per the caller.
        unsafe {
            let mut params: sys::ucp_params_t = std::mem::zeroed();
            params.field_mask = (sys::ucp_params_field::UCP_PARAM_FIELD_FEATURES | sys::ucp_params_field::UCP_PARAM_FIELD_MT_WORKERS_SHARED) as u64;
            params.features = features;
            // Context-level calls (registering and unregistering memory)
            // come from any thread while a UCX thread drives the workers:
            // UCX then locks them.
            params.mt_workers_shared = 1;
            let mut context = ptr::null_mut();
            check("ucp_init", sys::ucp_init(&params, config, &mut context))?;
            Ok(Self { handle: Arc::new(ContextHandle(context)) })
        }
    }
}
