//! The `kubernetes` connector: each pool is a Deployment whose replicas
//! the planner sets through its `scale` subresource, as `kubectl scale`
//! and the HorizontalPodAutoscaler do.
//!
//! - An action is one merge patch of the scale, `{"spec": {"replicas":
//!   N}}`, by field manager `turbine-planner`: an absolute size, so
//!   carrying out an action again (after a restart) changes nothing.
//! - Kubernetes carries it out: new pods start and join the registry when
//!   ready; for a scale-down, the ReplicaSet sends SIGTERM to the pods it
//!   picks, on which a worker leaves the registry, finishes its streams
//!   and exits (within the pod's `terminationGracePeriodSeconds`).
//! - A pool counts the replicas the scale's status reports.
//! - The planner's service account needs `get` and `patch` on
//!   `deployments/scale` in the namespace, nothing else.

use std::collections::BTreeMap;
#[cfg(feature = "kubernetes")]
use std::collections::HashMap;
#[cfg(feature = "kubernetes")]
use std::sync::Arc;

#[cfg(feature = "kubernetes")]
use k8s_openapi::api::apps::v1::Deployment;
#[cfg(feature = "kubernetes")]
use kube::api::{Api, Patch, PatchParams};
#[cfg(feature = "kubernetes")]
use tokio::sync::Mutex;

#[cfg(feature = "kubernetes")]
use crate::act::connector::Outcome;
#[cfg(feature = "kubernetes")]
use crate::plan::Action;

/// The field manager the planner's patches carry.
pub const FIELD_MANAGER: &str = "turbine-planner";

/// Each pool's Deployment is `<prefix><pool>` unless mapped.
pub const DEPLOYMENT_PREFIX: &str = "turbine-worker-";

/// The kubernetes connector (feature `kubernetes`). Cloning shares the
/// client.
#[cfg(feature = "kubernetes")]
#[derive(Clone)]
pub struct KubernetesConnector {
    deployments: Api<Deployment>,
    namespace: String,
    /// Pool → Deployment, where not `<prefix><pool>`.
    names: Arc<BTreeMap<String, String>>,
    /// What each action carried out answered.
    done: Arc<Mutex<HashMap<String, Outcome>>>,
}

#[cfg(feature = "kubernetes")]
impl std::fmt::Debug for KubernetesConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesConnector").field("namespace", &self.namespace).field("names", &self.names).finish_non_exhaustive()
    }
}

/// Pools mapped to Deployments by `pool=deployment` (`--kubernetes-deployments`),
/// or why a mapping is refused.
pub fn parse_mapping(mappings: &[String]) -> Result<BTreeMap<String, String>, MappingError> {
    let mut names = BTreeMap::new();
    for mapping in mappings {
        let (pool, deployment) = mapping.split_once('=').ok_or_else(|| MappingError::NotAPair(mapping.clone()))?;
        if pool.is_empty() || !is_dns_label(deployment) {
            return Err(MappingError::BadName(mapping.clone()));
        }
        if names.insert(pool.to_owned(), deployment.to_owned()).is_some() {
            return Err(MappingError::Twice(pool.to_owned()));
        }
    }
    Ok(names)
}

/// Why a `pool=deployment` mapping is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MappingError {
    /// No `=`.
    #[error("{0:?} is not pool=deployment")]
    NotAPair(String),
    /// An empty pool, or a Deployment name that is not a DNS label.
    #[error("{0:?}: the pool must be named and the Deployment a DNS label (lowercase letters, digits, '-', at most 63)")]
    BadName(String),
    /// A pool mapped twice.
    #[error("pool {0:?} is mapped twice")]
    Twice(String),
}

/// A Kubernetes object name as a DNS-1123 label.
fn is_dns_label(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name.bytes().all(|byte| byte.is_ascii_lowercase() || byte.is_ascii_digit() || byte == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

#[cfg(feature = "kubernetes")]
impl KubernetesConnector {
    /// The connector over `client`, in `namespace` (the client's own when
    /// `None`), with pools mapped to Deployments by `names`.
    pub fn new(client: kube::Client, namespace: Option<&str>, names: BTreeMap<String, String>) -> Self {
        let namespace = namespace.map_or_else(|| client.default_namespace().to_owned(), str::to_owned);
        Self { deployments: Api::namespaced(client, &namespace), namespace, names: Arc::new(names), done: Arc::default() }
    }

    /// The connector with the client configured as kubectl's would be: in
    /// a pod, its service account; elsewhere, `KUBECONFIG` or
    /// `~/.kube/config`.
    pub async fn connect(namespace: Option<&str>, names: BTreeMap<String, String>) -> Result<Self, kube::Error> {
        Ok(Self::new(kube::Client::try_default().await?, namespace, names))
    }

    /// The Deployment of `pool`.
    pub fn deployment(&self, pool: &str) -> String {
        self.names.get(pool).cloned().unwrap_or_else(|| format!("{DEPLOYMENT_PREFIX}{pool}"))
    }

    /// The replicas of `pool`'s Deployment, as its scale's status counts
    /// them (`None` when the API server does not answer).
    pub async fn serving(&self, pool: &str) -> Option<u32> {
        let name = self.deployment(pool);
        match self.deployments.get_scale(&name).await {
            Ok(scale) => Some(scale.status.map_or(0, |status| status.replicas.max(0) as u32)),
            Err(error) => {
                tracing::warn!(deployment = name, namespace = self.namespace, %error, "cannot read the Deployment's scale");
                None
            }
        }
    }

    /// Sets `action.pool`'s Deployment to `action.replicas`.
    pub async fn execute(&self, action: &Action) -> Outcome {
        let mut done = self.done.lock().await;
        if let Some(outcome) = done.get(&action.id) {
            return outcome.clone();
        }
        let name = self.deployment(&action.pool);
        let patch = serde_json::json!({ "spec": { "replicas": action.replicas } });
        let params = PatchParams { field_manager: Some(FIELD_MANAGER.to_owned()), ..PatchParams::default() };
        let outcome = match self.deployments.patch_scale(&name, &params, &Patch::Merge(&patch)).await {
            Ok(scale) => {
                let running = scale.status.map_or(0, |status| status.replicas);
                Outcome::Done(format!("Deployment {}/{name} scaled to {} replicas ({running} running)", self.namespace, action.replicas))
            }
            Err(error) => Outcome::Failed(format!("cannot scale Deployment {}/{name}: {}", self.namespace, describe(&error))),
        };
        done.insert(action.id.clone(), outcome.clone());
        outcome
    }
}

/// An API error in words, with the status code that says what to fix.
#[cfg(feature = "kubernetes")]
fn describe(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(status) => {
            let hint = match status.code {
                404 => " (no such Deployment: see --kubernetes-deployments)",
                401 | 403 => " (the planner's service account needs get and patch on deployments/scale)",
                _ => "",
            };
            format!("{} {}{hint}", status.code, status.message)
        }
        other => other.to_string(),
    }
}
