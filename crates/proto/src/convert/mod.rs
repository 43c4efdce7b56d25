//! Conversions between the generated messages and the domain types of
//! `turbine-kv` and `turbine-tokens`, in one place: `TryFrom<pb::X>` checks what the wire cannot (missing messages,
//! unknown enum values, ranges) and reports it as a [`ConversionError`];
//! `From<&X>` builds the message. Every conversion destructures its input
//! exhaustively, so a field added to either side is a compile error here
//! until it is handled.
//!
//! The request vocabulary (`turbine-api`) converts in that crate, beside
//! its types, and so do the types a service owns (a router's decision, a
//! worker's KV handle): this crate links none of them.

mod kvindex;
mod layout;
mod worker;

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
