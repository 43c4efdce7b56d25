//! The models the gateway can serve, learned from the live workers: each
//! model's card is fetched once from one of its workers and compiled into a
//! [`Preprocessor`] (tokenizer + chat template).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use turbine_api::router::{RoutedWorker, RouterClient};
use turbine_api::worker::WorkerClients;
use turbine_runtime::CancellationToken;
use turbine_tokens::Preprocessor;

use crate::error::{ErrorKind, GatewayError};

/// A model as listed to clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedModel {
    /// Name.
    pub name: String,
    /// Context length of its card.
    pub context_length: u32,
    /// Live workers serving it.
    pub workers: u32,
}

#[derive(Debug, Default)]
struct State {
    compiled: HashMap<String, Arc<Preprocessor>>,
    listed: BTreeMap<String, ListedModel>,
    refreshed_at: Option<Instant>,
}

/// Models served by live workers.
#[derive(Debug)]
pub struct ModelCatalog {
    router: RouterClient,
    workers: WorkerClients,
    state: RwLock<State>,
    refreshing: tokio::sync::Mutex<()>,
}

/// A request for an unknown model refreshes at most this often.
const MIN_REFRESH_GAP: Duration = Duration::from_millis(100);

impl ModelCatalog {
    /// An empty catalog fed from `router`'s worker list.
    pub fn new(router: RouterClient, workers: WorkerClients) -> Self {
        Self { router, workers, state: RwLock::default(), refreshing: tokio::sync::Mutex::new(()) }
    }

    /// Re-reads the live workers; fetches and compiles the card of every
    /// model not seen before. Returns whether the router answered.
    pub async fn refresh(&self) -> Result<(), GatewayError> {
        let _single_flight = self.refreshing.lock().await;
        let workers = self.router.workers(None).await?;
        let mut by_model: BTreeMap<&str, Vec<&RoutedWorker>> = BTreeMap::new();
        for worker in &workers {
            by_model.entry(worker.model.as_str()).or_default().push(worker);
        }
        let mut listed = BTreeMap::new();
        for (model, serving) in &by_model {
            let compiled = self.state.read().compiled.get(*model).cloned();
            let preprocessor = match compiled {
                Some(preprocessor) => Some(preprocessor),
                None => self.compile(model, serving).await,
            };
            if let Some(preprocessor) = preprocessor {
                let context_length = preprocessor.card().context_length;
                listed.insert((*model).to_owned(), ListedModel { name: (*model).to_owned(), context_length, workers: serving.len() as u32 });
            }
        }
        let mut state = self.state.write();
        state.listed = listed;
        state.refreshed_at = Some(Instant::now());
        Ok(())
    }

    /// Fetches the card from the first worker that answers and compiles it.
    async fn compile(&self, model: &str, serving: &[&RoutedWorker]) -> Option<Arc<Preprocessor>> {
        for worker in serving {
            let card = match self.workers.client(&worker.worker_id, &worker.endpoint) {
                Ok(client) => client.model_card().await,
                Err(error) => {
                    tracing::warn!(worker = %worker.worker_id, %error, "no client for worker");
                    continue;
                }
            };
            let card = match card {
                Ok(card) => card,
                Err(error) => {
                    tracing::warn!(worker = %worker.worker_id, %error, "model card fetch failed");
                    continue;
                }
            };
            match tokio::task::spawn_blocking(move || Preprocessor::new(card)).await {
                Ok(Ok(preprocessor)) => {
                    tracing::info!(model, worker = %worker.worker_id, "model card compiled");
                    let preprocessor = Arc::new(preprocessor);
                    self.state.write().compiled.insert(model.to_owned(), preprocessor.clone());
                    return Some(preprocessor);
                }
                Ok(Err(error)) => tracing::error!(model, %error, "model card does not compile"),
                Err(error) => tracing::error!(model, %error, "model card compilation panicked"),
            }
        }
        None
    }

    /// The compiled model, refreshing once if it is not known yet.
    pub async fn get(&self, model: &str) -> Result<Arc<Preprocessor>, GatewayError> {
        if let Some(preprocessor) = self.state.read().compiled.get(model) {
            return Ok(preprocessor.clone());
        }
        let stale = self.state.read().refreshed_at.is_none_or(|at| at.elapsed() >= MIN_REFRESH_GAP);
        if stale {
            self.refresh().await?;
        }
        self.state.read().compiled.get(model).cloned().ok_or_else(|| GatewayError::model_not_found(model))
    }

    /// Models with at least one live worker, by name.
    pub fn listed(&self) -> Vec<ListedModel> {
        self.state.read().listed.values().cloned().collect()
    }

    /// Refreshes every `interval` until `shutdown`; readiness follows
    /// whether the router answers.
    pub fn spawn_refresh(self: &Arc<Self>, interval: Duration, shutdown: CancellationToken, on_result: impl Fn(bool) + Send + 'static) {
        let catalog = self.clone();
        tokio::spawn(async move {
            loop {
                let result = catalog.refresh().await;
                if let Err(error) = &result {
                    tracing::debug!(%error, "model refresh failed");
                }
                on_result(result.is_ok());
                tokio::select! {
                    () = tokio::time::sleep(interval) => {}
                    () = shutdown.cancelled() => return,
                }
            }
        });
    }
}

impl From<turbine_tokens::Error> for GatewayError {
    fn from(error: turbine_tokens::Error) -> Self {
        match error {
            turbine_tokens::Error::Template(message) => GatewayError::invalid("messages", message),
            turbine_tokens::Error::Tokenizer(message) => GatewayError::new(ErrorKind::InvalidRequest, format!("cannot tokenize the prompt: {message}")),
            other => {
                tracing::error!(error = %other, "model preprocessing failed");
                GatewayError::new(ErrorKind::Internal, "model preprocessing failed")
            }
        }
    }
}
