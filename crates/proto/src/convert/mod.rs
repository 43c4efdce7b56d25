//! Conversions between the generated messages and the domain types of the
//! shared crates (`turbine-kv`, `turbine-engine`, `turbine-tokens`), in one
//! place: `TryFrom<pb::X>` checks what the wire cannot (missing messages,
//! unknown enum values, ranges) and reports it as a [`ConversionError`];
//! `From<&X>` builds the message. Every conversion destructures its input
//! exhaustively, so a field added to either side is a compile error here
//! until it is handled.
//!
//! Types a service owns (a router's decision, a worker's KV handle) convert
//! in that service's crate, next to the type.

/// `UcxRegion` both ways for a package's copy of the message
/// (`turbine.worker.v1` and `turbine.kvstore.v1` each carry one, field for
/// field the same, so that neither package imports the other).
macro_rules! ucx_region_conversions {
    ($message:path) => {
        impl From<&turbine_api::UcxRegion> for $message {
            fn from(region: &turbine_api::UcxRegion) -> Self {
                let turbine_api::UcxRegion { worker_address, remote_key, base_address, length, shm_worker_address, shm_remote_key } = region.clone();
                Self { worker_address, remote_key, base_address, length, shm_worker_address, shm_remote_key }
            }
        }

        impl From<$message> for turbine_api::UcxRegion {
            fn from(region: $message) -> Self {
                let $message { worker_address, remote_key, base_address, length, shm_worker_address, shm_remote_key } = region;
                Self { worker_address, remote_key, base_address, length, shm_worker_address, shm_remote_key }
            }
        }
    };
}

ucx_region_conversions!(crate::worker::v1::UcxRegion);
ucx_region_conversions!(crate::kvstore::v1::UcxRegion);

mod kvindex;
mod worker;

pub use worker::{finish_reason, generate_request};

/// Why a message does not convert into its domain type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConversionError {
    /// A required message or field is absent.
    #[error("{0} is required")]
    Missing(&'static str),
    /// An enum field holds a value this version does not know.
    #[error("{field} has the unknown value {value}")]
    UnknownEnum {
        /// The field.
        field: &'static str,
        /// Its value on the wire.
        value: i32,
    },
    /// A field's value is out of its range or inconsistent.
    #[error("{field} {message}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
}

impl ConversionError {
    /// An invalid `field`.
    pub fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid { field, message: message.into() }
    }
}

impl From<ConversionError> for tonic::Status {
    fn from(error: ConversionError) -> Self {
        tonic::Status::invalid_argument(error.to_string())
    }
}

/// Result of a conversion.
pub type ConversionResult<T> = Result<T, ConversionError>;
