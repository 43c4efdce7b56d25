//! What a block is keyed by in the store, and why the store refuses
//! blocks: the words the store, its disk tier, its data path, its gRPC
//! shell and its client share.

use std::sync::Arc;

use turbine_kv::{KvTenant, SequenceHash};
use turbine_runtime::trust::Peer;

pub use turbine_api::kv_store::Fingerprint;

/// Where a block lives in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockKey {
    /// Its model and layout.
    pub fingerprint: Fingerprint,
    /// The prefix it ends.
    pub sequence: SequenceHash,
}

/// Why blocks were refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StoreError {
    /// A block's bytes do not match its checksum.
    #[error("block {0:016x}: its bytes do not match its checksum")]
    Corrupt(u64),
    /// A fingerprint that declares no block size.
    #[error("fingerprint {0:016x} declares no block size (its top 32 bits are the bytes of each block)")]
    Undeclared(u64),
    /// A block's size differs from the one its fingerprint declares.
    #[error("block {sequence:016x} is {got} bytes; fingerprint {fingerprint:016x} declares blocks of {expected}")]
    WrongSize {
        /// The block.
        sequence: u64,
        /// Its fingerprint.
        fingerprint: u64,
        /// The size the fingerprint declares.
        expected: usize,
        /// This block's.
        got: usize,
    },
    /// A block larger than the whole store.
    #[error("a block of {0} bytes does not fit the store's memory ({1} bytes)")]
    TooLarge(usize, u64),
}

/// Whose blocks a caller may write and read: every tenant's, or only the
/// tenants its worker certificate names (`turbine certs --worker-tenant`:
/// a pool that serves one tenant cannot write, nor read, another's blocks
/// in the shared store). Plaintext callers and certificates naming no
/// tenant are [`Any`](Self::Any).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum TenantScope {
    /// Every tenant's blocks.
    #[default]
    Any,
    /// Only these tenants' (wire values).
    Only {
        /// Who the certificate names (for the refusal's words).
        holder: String,
        /// The tenants.
        tenants: Arc<[u64]>,
    },
}

impl TenantScope {
    /// The scope of a caller authenticated as `peer` (None: plaintext).
    pub fn of(peer: Option<&Peer>) -> Self {
        match peer.and_then(|peer| Some((peer.name.clone(), peer.kv_tenants.clone()?))) {
            Some((holder, tenants)) => Self::Only { holder, tenants },
            None => Self::Any,
        }
    }

    /// Whether the caller may write and read `tenant`'s blocks.
    pub fn allows(&self, tenant: KvTenant) -> bool {
        match self {
            Self::Any => true,
            Self::Only { tenants, .. } => tenants.contains(&tenant.get()),
        }
    }

    /// Why the caller may not write block `sequence` of `tenant`.
    pub fn refusal(&self, sequence: SequenceHash, tenant: KvTenant) -> String {
        let (holder, tenants) = match self {
            Self::Any => ("", &[][..]),
            Self::Only { holder, tenants } => (holder.as_str(), &tenants[..]),
        };
        let allowed: Vec<String> = tenants.iter().map(|tenant| format!("{tenant:016x}")).collect();
        format!(
            "block {:016x} is charged to KV tenant {:016x}; the certificate of {holder:?} allows only KV tenants [{}]",
            sequence.0,
            tenant.get(),
            allowed.join(", ")
        )
    }
}
