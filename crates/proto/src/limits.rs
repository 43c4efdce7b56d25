//! Message-size limits, set in one place for every server and client.
//!
//! tonic's defaults are 4 MiB to receive and no limit at all to send; a
//! model card carries a vocabulary of a few MiB, a KV block a few hundred
//! KiB, prompts far less. Every generated server and client implements
//! [`MessageLimits`], and the service host and the service clients apply
//! it: no call site picks a number.

use tonic::codegen::{Body, Bytes, StdError};

/// Largest gRPC message a Turbine server or client accepts or sends.
pub const MAX_MESSAGE_BYTES: usize = 32 << 20;

/// A generated server or client whose message sizes can be bounded.
pub trait MessageLimits: Sized {
    /// Bounds received and sent messages to `bytes`.
    fn with_message_limit(self, bytes: usize) -> Self;

    /// Bounds received and sent messages to [`MAX_MESSAGE_BYTES`].
    fn with_message_limits(self) -> Self {
        self.with_message_limit(MAX_MESSAGE_BYTES)
    }
}

macro_rules! servers {
    ($($server:path),* $(,)?) => {$(
        impl<T> MessageLimits for $server {
            fn with_message_limit(self, bytes: usize) -> Self {
                self.max_decoding_message_size(bytes).max_encoding_message_size(bytes)
            }
        }
    )*};
}

macro_rules! clients {
    ($($client:path),* $(,)?) => {$(
        impl<T> MessageLimits for $client
        where
            T: tonic::client::GrpcService<tonic::body::Body>,
            T::Error: Into<StdError>,
            T::ResponseBody: Body<Data = Bytes> + Send + 'static,
            <T::ResponseBody as Body>::Error: Into<StdError> + Send,
        {
            fn with_message_limit(self, bytes: usize) -> Self {
                self.max_decoding_message_size(bytes).max_encoding_message_size(bytes)
            }
        }
    )*};
}

servers!(
    crate::gateway::v1::inference_server::InferenceServer<T>,
    crate::kvindex::v1::kv_index_server::KvIndexServer<T>,
    crate::kvstore::v1::kv_store_server::KvStoreServer<T>,
    crate::planner::v1::planner_server::PlannerServer<T>,
    crate::router::v1::router_server::RouterServer<T>,
    crate::worker::v1::worker_server::WorkerServer<T>,
    crate::worker::v1::kv_transfer_server::KvTransferServer<T>,
);

clients!(
    crate::gateway::v1::inference_client::InferenceClient<T>,
    crate::kvindex::v1::kv_index_client::KvIndexClient<T>,
    crate::kvstore::v1::kv_store_client::KvStoreClient<T>,
    crate::planner::v1::planner_client::PlannerClient<T>,
    crate::router::v1::router_client::RouterClient<T>,
    crate::worker::v1::worker_client::WorkerClient<T>,
    crate::worker::v1::kv_transfer_client::KvTransferClient<T>,
);
