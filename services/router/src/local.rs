//! The router as its own client's [`RouterApi`]: a caller in this process
//! (the embedded cluster) calls [`Router`] directly, through the same
//! `turbine_api::router::RouterClient` a remote caller uses.

use std::time::Instant;

use turbine_api::router::{RouteRequest, Routed, RoutedWorker, RouterApi, RouterCallError};

use crate::router::{RouteError, Router};

/// A decision the router refused, as its callers see it.
impl From<RouteError> for RouterCallError {
    fn from(error: RouteError) -> Self {
        match error {
            RouteError::NoWorkers(_) | RouteError::NoneKeepsApart(_) => RouterCallError::NoWorkers(error.to_string()),
            RouteError::InvalidRequest(message) => RouterCallError::InvalidRequest(message),
            RouteError::NoneHoldsFormat { .. } => RouterCallError::Unserved(error.to_string()),
        }
    }
}

#[tonic::async_trait]
impl RouterApi for Router {
    async fn route(&self, request: RouteRequest) -> Result<Routed, RouterCallError> {
        let started = Instant::now();
        let result = Router::route(self, &request).await;
        let outcome = result.as_ref().map_or_else(RouteError::outcome, |_| "routed");
        crate::metrics::decision(request.policy.unwrap_or(self.policy()), outcome, started.elapsed());
        Ok(result?)
    }

    async fn prefill_done(&self, request_id: String) -> Result<bool, RouterCallError> {
        Ok(Router::prefill_done(self, &request_id))
    }

    async fn finished(&self, request_id: String) -> Result<bool, RouterCallError> {
        Ok(Router::finished(self, &request_id))
    }

    async fn workers(&self, model: Option<String>) -> Result<Vec<RoutedWorker>, RouterCallError> {
        Ok(Router::workers(self, model.as_deref()))
    }
}
