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

mod context;
mod endpoint;
mod error;
mod memory;
mod worker;

pub use context::Context;
pub use endpoint::{Endpoint, RemoteKey, Request};
pub use error::{UcxError, WaitError};
pub use memory::MemoryRegion;
pub use worker::{Waker, Worker};
