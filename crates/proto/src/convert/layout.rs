//! The KV layout and `UcxRegion` (`turbine-kv`'s, which both the worker
//! and the kv-store packages carry) to and from their messages.

use turbine_kv::KvLayout;

use crate::worker::v1 as pb;
use crate::{ConversionError, ConversionResult};

/// `UcxRegion` both ways for a package's copy of the message
/// (`turbine.worker.v1` and `turbine.kvstore.v1` each carry one, field for
/// field the same, so that neither package imports the other).
macro_rules! ucx_region_conversions {
    ($message:path, $range:ty) => {
        impl From<&turbine_kv::UcxRegion> for $message {
            fn from(region: &turbine_kv::UcxRegion) -> Self {
                type Range = $range;
                let turbine_kv::UcxRegion { worker_address, remote_key, base_address, length, shm_worker_address, shm_remote_key, range_keys } = region.clone();
                let range_keys =
                    range_keys.into_iter().map(|turbine_kv::UcxRangeKey { offset, length, remote_key }| Range { offset, length, remote_key }).collect();
                Self { worker_address, remote_key, base_address, length, shm_worker_address, shm_remote_key, range_keys }
            }
        }

        impl From<$message> for turbine_kv::UcxRegion {
            fn from(region: $message) -> Self {
                type Range = $range;
                let $message { worker_address, remote_key, base_address, length, shm_worker_address, shm_remote_key, range_keys } = region;
                let range_keys =
                    range_keys.into_iter().map(|Range { offset, length, remote_key }| turbine_kv::UcxRangeKey { offset, length, remote_key }).collect();
                Self { worker_address, remote_key, base_address, length, shm_worker_address, shm_remote_key, range_keys }
            }
        }
    };
}

ucx_region_conversions!(crate::worker::v1::UcxRegion, crate::worker::v1::UcxRangeKey);
ucx_region_conversions!(crate::kvstore::v1::UcxRegion, crate::kvstore::v1::UcxRangeKey);

impl From<&KvLayout> for pb::KvLayout {
    fn from(layout: &KvLayout) -> Self {
        let KvLayout { block_bytes, block_size, layers, kv_heads, head_dim, dtype, order } = layout;
        pb::KvLayout {
            block_bytes: *block_bytes as u64,
            block_size: *block_size as u32,
            layers: *layers as u32,
            kv_heads: *kv_heads as u32,
            head_dim: *head_dim as u32,
            dtype: dtype.clone(),
            order: order.clone(),
        }
    }
}

impl TryFrom<pb::KvLayout> for KvLayout {
    type Error = ConversionError;

    fn try_from(layout: pb::KvLayout) -> ConversionResult<Self> {
        let pb::KvLayout { block_bytes, block_size, layers, kv_heads, head_dim, dtype, order } = layout;
        let block_bytes =
            usize::try_from(block_bytes).map_err(|_| ConversionError::invalid("layout.block_bytes", format!("{block_bytes} does not fit this machine")))?;
        if block_bytes == 0 {
            return Err(ConversionError::invalid("layout.block_bytes", "must be positive"));
        }
        Ok(KvLayout {
            block_bytes,
            block_size: block_size as usize,
            layers: layers as usize,
            kv_heads: kv_heads as usize,
            head_dim: head_dim as usize,
            dtype,
            order,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_and_regions_convert_both_ways() {
        let layout = KvLayout::opaque(4096, "test");
        assert_eq!(KvLayout::try_from(pb::KvLayout::from(&layout)).unwrap(), layout);
        assert!(KvLayout::try_from(pb::KvLayout::default()).is_err(), "a zero block size is refused");
        let region = turbine_kv::UcxRegion {
            worker_address: vec![1],
            remote_key: vec![2],
            base_address: 3,
            length: 4,
            shm_worker_address: vec![5],
            shm_remote_key: vec![6],
            range_keys: Vec::new(),
        };
        assert_eq!(turbine_kv::UcxRegion::from(pb::UcxRegion::from(&region)), region);
        assert_eq!(turbine_kv::UcxRegion::from(crate::kvstore::v1::UcxRegion::from(&region)), region);
        let keyed =
            turbine_kv::UcxRegion { remote_key: Vec::new(), range_keys: vec![turbine_kv::UcxRangeKey { offset: 7, length: 8, remote_key: vec![9] }], ..region };
        assert_eq!(turbine_kv::UcxRegion::from(pb::UcxRegion::from(&keyed)), keyed);
        assert_eq!(turbine_kv::UcxRegion::from(crate::kvstore::v1::UcxRegion::from(&keyed)), keyed);
    }
}
