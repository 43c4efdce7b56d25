//! [`WorkerId`]: a worker's name across the cluster.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

/// The identity of a worker: its registry record, its KV events, the index's
/// view of its cache and the router's bookings all name it by this. Cheap to
/// clone (shared), compared and hashed as its text.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(Arc<str>);

impl WorkerId {
    /// A worker id from its text.
    pub fn new(id: impl Into<Arc<str>>) -> Self {
        Self(id.into())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the id is empty (never a valid worker).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The index's name for the blocks kv-store `store_id` holds in layout
    /// `fingerprint`: no worker routed to, but a holder whose blocks every
    /// worker reading that store in that layout can fetch.
    pub fn of_store(store_id: &str, fingerprint: u64) -> Self {
        Self::from(format!("{STORE_PREFIX}{store_id}/{fingerprint:016x}"))
    }

    /// The store and fingerprint of a name made by
    /// [`of_store`](Self::of_store); None for a worker's.
    pub fn store_part(&self) -> Option<(&str, u64)> {
        let (store_id, fingerprint) = self.0.strip_prefix(STORE_PREFIX)?.rsplit_once('/')?;
        let fingerprint = u64::from_str_radix(fingerprint, 16).ok().filter(|_| fingerprint.len() == 16)?;
        (!store_id.is_empty()).then_some((store_id, fingerprint))
    }
}

/// What every kv-store's name in the index starts with (a worker's id may
/// not).
pub const STORE_PREFIX: &str = "kv-store/";

impl Deref for WorkerId {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for WorkerId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for WorkerId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl From<&str> for WorkerId {
    fn from(id: &str) -> Self {
        Self(Arc::from(id))
    }
}

impl From<String> for WorkerId {
    fn from(id: String) -> Self {
        Self(Arc::from(id))
    }
}

impl From<&String> for WorkerId {
    fn from(id: &String) -> Self {
        Self(Arc::from(id.as_str()))
    }
}

impl From<WorkerId> for String {
    fn from(id: WorkerId) -> Self {
        id.0.to_string()
    }
}

impl PartialEq<str> for WorkerId {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for WorkerId {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl serde::Serialize for WorkerId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for WorkerId {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer).map(Self::from)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn looks_up_by_text_and_prints_as_text() {
        let mut books: HashMap<WorkerId, u32> = HashMap::new();
        books.insert(WorkerId::from("w-1"), 3);
        assert_eq!(books.get("w-1"), Some(&3));
        assert_eq!(WorkerId::from("w-1").to_string(), "w-1");
        assert_eq!(format!("{:?}", WorkerId::from("w-1")), "\"w-1\"");
        assert_eq!(serde_json::to_string(&WorkerId::from("w-1")).unwrap(), "\"w-1\"");
        assert_eq!(serde_json::from_str::<WorkerId>("\"w-2\"").unwrap(), "w-2");
    }

    #[test]
    fn a_store_name_carries_its_store_and_fingerprint() {
        let id = WorkerId::of_store("shared", 0xab);
        assert_eq!(id, "kv-store/shared/00000000000000ab");
        assert_eq!(id.store_part(), Some(("shared", 0xab)));
        assert_eq!(WorkerId::of_store("a/b", u64::MAX).store_part(), Some(("a/b", u64::MAX)));
        for worker in ["w-1", "kv-store/x", "kv-store//00000000000000ab", "kv-store/x/ab"] {
            assert_eq!(WorkerId::from(worker).store_part(), None, "{worker}");
        }
    }
}
