//! Memory registered for one-sided reads ([`MemoryRegion`]).

use std::ptr;

use turbine_ucx_sys as sys;

use crate::error::check;
use crate::{Context, UcxError};

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
    /// owner's help ([`RemoteKey::local_ptr`](crate::RemoteKey::local_ptr)). The memory is zeroed by the
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
