//! Turbine's gRPC contracts, generated from `proto/` at build time.
//!
//! One module per package and version (`gateway::v1`, `kvindex::v1`,
//! `kvstore::v1`, `planner::v1`, `router::v1`, `worker::v1`), mirroring `proto/turbine/<service>/v1/`. Each module also
//! exports its encoded `FILE_DESCRIPTOR_SET` (with comments), which servers
//! register with gRPC reflection so `grpcurl list` and `describe` work.
//!
//! Generated types stop at the service edge: [`convert`] turns them into the
//! shared crates' domain types (and back), checked, with a typed
//! [`ConversionError`]; [`MessageLimits`] bounds every server's and client's
//! message sizes in one place.

pub mod convert;
mod limits;

pub use convert::{ConversionError, ConversionResult};
pub use limits::{MAX_MESSAGE_BYTES, MessageLimits};

/// `turbine.gateway.*` packages.
#[allow(clippy::all, missing_docs)]
pub mod gateway {
    /// `turbine.gateway.v1`: the text-in, text-out Inference API.
    pub mod v1 {
        tonic::include_proto!("turbine.gateway.v1");
        /// Encoded descriptor set of `turbine.gateway.v1`, source info included.
        pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/turbine.gateway.v1.bin"));
    }
}

/// `turbine.kvindex.*` packages.
#[allow(clippy::all, missing_docs)]
pub mod kvindex {
    /// `turbine.kvindex.v1`: the global KV index service, KV events, event
    /// batches, cache dumps and index snapshots.
    pub mod v1 {
        tonic::include_proto!("turbine.kvindex.v1");
        /// Encoded descriptor set of `turbine.kvindex.v1`, source info included.
        pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/turbine.kvindex.v1.bin"));
    }
}

/// `turbine.kvstore.*` packages.
#[allow(clippy::all, missing_docs)]
pub mod kvstore {
    /// `turbine.kvstore.v1`: the shared KV block store (the G4 tier).
    pub mod v1 {
        tonic::include_proto!("turbine.kvstore.v1");
        /// Encoded descriptor set of `turbine.kvstore.v1`, source info included.
        pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/turbine.kvstore.v1.bin"));
    }
}

/// `turbine.planner.*` packages.
#[allow(clippy::all, missing_docs)]
pub mod planner {
    /// `turbine.planner.v1`: SLA-driven sizing of the worker pools.
    pub mod v1 {
        tonic::include_proto!("turbine.planner.v1");
        /// Encoded descriptor set of `turbine.planner.v1`, source info included.
        pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/turbine.planner.v1.bin"));
    }
}

/// `turbine.router.*` packages.
#[allow(clippy::all, missing_docs)]
pub mod router {
    /// `turbine.router.v1`: worker selection and load bookkeeping.
    pub mod v1 {
        tonic::include_proto!("turbine.router.v1");
        /// Encoded descriptor set of `turbine.router.v1`, source info included.
        pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/turbine.router.v1.bin"));
    }
}

/// `turbine.worker.*` packages.
#[allow(clippy::all, missing_docs)]
pub mod worker {
    /// `turbine.worker.v1`: token generation on one engine.
    pub mod v1 {
        tonic::include_proto!("turbine.worker.v1");
        /// Encoded descriptor set of `turbine.worker.v1`, source info included.
        pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/turbine.worker.v1.bin"));
    }
}

/// Fully qualified gRPC service names, as used by health checks and reflection.
pub mod service_names {
    /// `turbine.gateway.v1.Inference`
    pub const GATEWAY_INFERENCE: &str = "turbine.gateway.v1.Inference";
    /// `turbine.kvindex.v1.KvIndex`
    pub const KV_INDEX: &str = "turbine.kvindex.v1.KvIndex";
    /// `turbine.kvstore.v1.KvStore`
    pub const KV_STORE: &str = "turbine.kvstore.v1.KvStore";
    /// `turbine.planner.v1.Planner`
    pub const PLANNER: &str = "turbine.planner.v1.Planner";
    /// `turbine.router.v1.Router`
    pub const ROUTER: &str = "turbine.router.v1.Router";
    /// `turbine.worker.v1.Worker`
    pub const WORKER: &str = "turbine.worker.v1.Worker";
    /// `turbine.worker.v1.KvTransfer`
    pub const KV_TRANSFER: &str = "turbine.worker.v1.KvTransfer";
}
