//! How workers exchange KV blocks: the layout both sides must share, and
//! where a worker's pool lies for peers that read it over UCX.

/// How a worker's KV blocks are laid out; two workers exchange blocks only
/// when their layouts are equal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    /// Bytes of one block (every layer's keys and values).
    pub block_bytes: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Transformer layers.
    pub layers: usize,
    /// Key/value heads per layer.
    pub kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
    /// Element type, e.g. "f16".
    pub dtype: String,
    /// Order of a block's contents, e.g. "layer,kv,token,head,dim".
    pub order: String,
}

impl KvLayout {
    /// A layout of opaque blocks of `block_bytes` (no model behind them:
    /// a benchmark's pool, a modelled transfer), told apart by `kind`.
    pub fn opaque(block_bytes: usize, kind: &str) -> Self {
        Self { block_bytes, block_size: 0, layers: 0, kv_heads: 0, head_dim: 0, dtype: kind.into(), order: kind.into() }
    }
}

/// How peers read a KV pool over UCX without its owner's engine taking
/// part: the owner's UCX worker addresses and packed remote keys (a main
/// context for every peer, and a shared-memory one for peers on the same
/// machine), and where the pool lies in the owner's address space.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UcxRegion {
    /// The owner's UCX worker address (main context).
    pub worker_address: Vec<u8>,
    /// The pool's packed remote key (main context).
    pub remote_key: Vec<u8>,
    /// The pool's first byte in the owner's address space.
    pub base_address: u64,
    /// The pool's length in bytes.
    pub length: u64,
    /// The owner's shared-memory UCX worker address (empty: none).
    pub shm_worker_address: Vec<u8>,
    /// The pool's packed remote key on the shared-memory context (empty: none).
    pub shm_remote_key: Vec<u8>,
    /// Keys for parts of the pool only, one per run of a handle's blocks
    /// (see [`UcxKeys::PerHandle`]): when any is given, `remote_key` is
    /// empty and a reader over the main context may read only within them.
    pub range_keys: Vec<UcxRangeKey>,
}

/// A packed remote key for `length` bytes at `offset` of a pool (a run of
/// one handle's blocks), valid until the handle is released.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UcxRangeKey {
    /// The run's first byte, from the pool's base.
    pub offset: u64,
    /// The run's bytes.
    pub length: u64,
    /// Its packed remote key (main context).
    pub remote_key: Vec<u8>,
}

impl UcxRegion {
    /// Whether `length` bytes at `offset` may be read, and through which
    /// key: `Some(None)` the pool's own, `Some(Some(i))` range key `i`,
    /// `None` outside what the owner exposed.
    pub fn key_for(&self, offset: u64, length: u64) -> Option<Option<usize>> {
        let end = offset.checked_add(length)?;
        if end > self.length {
            return None;
        }
        if self.range_keys.is_empty() {
            return Some(None);
        }
        self.range_keys.iter().position(|range| offset >= range.offset && end <= range.offset.saturating_add(range.length)).map(Some)
    }
}

/// How a worker's KV pool is keyed for peers reading over the main UCX
/// context (the network).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UcxKeys {
    /// The whole pool is registered once, and `Describe` hands its key to
    /// every handle's holder (plaintext deployments, where UCX's network
    /// is the deployment's and anyone on it is trusted anyway).
    #[default]
    WholePool,
    /// Each handle's blocks are registered on their own when the handle is
    /// made and unregistered at its release or expiry, and `Describe`
    /// hands out only those keys: on fabrics that enforce remote keys
    /// (RDMA) a handle's holder reads that handle's blocks and nothing
    /// else, and no longer once it is released.
    PerHandle,
}

impl UcxKeys {
    /// Keys for a service serving gRPC with certificates when `tls`, its
    /// UCX on `network`: per handle when it serves certificates and names
    /// a network for UCX (a fabric the operator trusts to carry blocks, but
    /// not with the whole pool), else the whole pool (no network: only
    /// same-machine readers of this user, who could read the process).
    pub fn for_service(network: &UcxNetwork, tls: bool) -> Self {
        match network {
            UcxNetwork::Off => UcxKeys::WholePool,
            _ if tls => UcxKeys::PerHandle,
            _ => UcxKeys::WholePool,
        }
    }
}

/// Which network devices a process's UCX may use. UCX authenticates no
/// one: over TCP a peer that reaches a UCX listener may read and write any
/// address of the process (UCX trusts its fabric), so UCX must never reach
/// further than the service's own trust boundary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UcxNetwork {
    /// UCX's own choice (`UCX_NET_DEVICES`, else every device it finds).
    Any,
    /// Only these devices, in UCX's syntax (`eth1`, `mlx5_0:1`, `lo`).
    Devices(String),
    /// No network device: peers on this machine read through shared
    /// memory (files only this user may open); others over gRPC.
    Off,
}

impl UcxNetwork {
    /// The devices of a service configured with `devices` (`all`: UCX's
    /// choice), serving gRPC on `grpc` with certificates when `tls`.
    /// Unconfigured, UCX reaches no further than the gRPC port: no network
    /// device under TLS (UCX cannot check a certificate), loopback only
    /// for a plaintext service on loopback, UCX's choice for a plaintext
    /// service other hosts reach (allowed only with `--insecure`).
    pub fn for_service(devices: Option<&str>, tls: bool, grpc: std::net::IpAddr) -> Self {
        match devices.map(str::trim) {
            Some("all") => UcxNetwork::Any,
            Some(devices) => UcxNetwork::Devices(devices.to_owned()),
            None if tls => UcxNetwork::Off,
            None if grpc.is_loopback() => UcxNetwork::Devices("lo".to_owned()),
            None => UcxNetwork::Any,
        }
    }
}

#[cfg(test)]
mod ucx_network_tests {
    use super::UcxNetwork;

    #[test]
    fn ucx_reaches_no_further_than_the_service() {
        let (loopback, everywhere) = ("127.0.0.1".parse().unwrap(), "0.0.0.0".parse().unwrap());
        assert_eq!(UcxNetwork::for_service(None, true, everywhere), UcxNetwork::Off);
        assert_eq!(UcxNetwork::for_service(None, true, loopback), UcxNetwork::Off);
        assert_eq!(UcxNetwork::for_service(None, false, loopback), UcxNetwork::Devices("lo".into()));
        assert_eq!(UcxNetwork::for_service(None, false, everywhere), UcxNetwork::Any);
        assert_eq!(UcxNetwork::for_service(Some("mlx5_0:1"), true, everywhere), UcxNetwork::Devices("mlx5_0:1".into()));
        assert_eq!(UcxNetwork::for_service(Some("all"), true, loopback), UcxNetwork::Any);
    }

    #[test]
    fn a_named_fabric_under_tls_is_keyed_per_handle() {
        use super::UcxKeys;
        let fabric = UcxNetwork::Devices("mlx5_0:1".into());
        assert_eq!(UcxKeys::for_service(&fabric, true), UcxKeys::PerHandle);
        assert_eq!(UcxKeys::for_service(&UcxNetwork::Any, true), UcxKeys::PerHandle);
        assert_eq!(UcxKeys::for_service(&UcxNetwork::Off, true), UcxKeys::WholePool);
        assert_eq!(UcxKeys::for_service(&fabric, false), UcxKeys::WholePool);
    }

    #[test]
    fn a_region_keyed_per_handle_reads_only_within_its_runs() {
        use super::{UcxRangeKey, UcxRegion};
        let whole = UcxRegion { remote_key: vec![1], length: 1000, ..UcxRegion::default() };
        assert_eq!(whole.key_for(900, 100), Some(None));
        assert_eq!(whole.key_for(901, 100), None);
        assert_eq!(whole.key_for(u64::MAX, 2), None);
        let run = |offset, length| UcxRangeKey { offset, length, remote_key: vec![2] };
        let keyed = UcxRegion { length: 1000, range_keys: vec![run(100, 200), run(500, 100)], ..UcxRegion::default() };
        assert_eq!(keyed.key_for(100, 100), Some(Some(0)));
        assert_eq!(keyed.key_for(200, 100), Some(Some(0)));
        assert_eq!(keyed.key_for(500, 100), Some(Some(1)));
        // Between the runs, across a run's end, and before the first.
        assert_eq!(keyed.key_for(300, 100), None);
        assert_eq!(keyed.key_for(250, 100), None);
        assert_eq!(keyed.key_for(0, 100), None);
    }
}
