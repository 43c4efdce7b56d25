//! Serving the planner on the service host.

use std::time::Duration;

use anyhow::Context;
use turbine_proto::planner::v1::{FILE_DESCRIPTOR_SET, planner_server::PlannerServer};
use turbine_proto::service_names;
use turbine_runtime::CancellationToken;
use turbine_runtime::host::{Host, HostSpec, Listeners, Role, RpcRoles};

use crate::act::connector::{Connector, ConnectorKind};
use crate::act::local::LocalConnector;
use crate::config::PlannerConfig;
use crate::cycle::Sizing;
use crate::ledger::Ledger;
use crate::observe::Observer;
use crate::plan::profile::Profile;
use crate::service::PlannerService;
use crate::state::PlannerState;
use turbine_registry::{RedisRegistry, Registry};

/// Who may call each rpc of `turbine.planner.v1.Planner`: reading the plan
/// is for operators and monitoring, changing it for operators (reporting
/// an action's outcome too: the external system of the `virtual`
/// connector operates the cluster).
pub const ROLES: &[RpcRoles] = &[
    RpcRoles { method: "/turbine.planner.v1.Planner/GetPlan", roles: &[Role::Operator, Role::Monitoring] },
    RpcRoles { method: "/turbine.planner.v1.Planner/WatchPlan", roles: &[Role::Operator, Role::Monitoring] },
    RpcRoles { method: "/turbine.planner.v1.Planner/History", roles: &[Role::Operator, Role::Monitoring] },
    RpcRoles { method: "/turbine.planner.v1.Planner/SetTargets", roles: &[Role::Operator] },
    RpcRoles { method: "/turbine.planner.v1.Planner/Pause", roles: &[Role::Operator] },
    RpcRoles { method: "/turbine.planner.v1.Planner/Resume", roles: &[Role::Operator] },
    RpcRoles { method: "/turbine.planner.v1.Planner/CompleteAction", roles: &[Role::Operator] },
];

const SPEC: HostSpec = HostSpec {
    name: "planner",
    health: &[service_names::PLANNER],
    descriptors: &[FILE_DESCRIPTOR_SET],
    handler_timeout: Duration::from_secs(30),
    roles: ROLES,
};

/// How often readiness checks that the database answers.
const DATABASE_PROBE: Duration = Duration::from_secs(2);

/// Serves `state` on `listeners` until `shutdown` fires, then drains; with
/// an `observer`, runs the planner's cycle beside. The planner is ready
/// while its database answers.
pub async fn serve(
    config: PlannerConfig,
    state: PlannerState,
    cycle: Option<(Observer, Sizing)>,
    listeners: Listeners,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut host = Host::new(SPEC, &config.server, listeners).await?;
    host.add_service(PlannerServer::new(PlannerService::new(state.clone(), shutdown.clone())));
    let mut serving = host.start(shutdown.clone())?;
    if let Some((observer, sizing)) = cycle {
        serving.spawn(tokio::spawn(crate::cycle::run(state.clone(), observer, sizing, shutdown)));
    }
    let ledger = state.ledger().clone();
    serving
        .ready_when(DATABASE_PROBE, move || {
            let ledger = ledger.clone();
            async move { ledger.ping().await.is_ok() }
        })
        .await;
    serving.until_shutdown(async {}).await
}

/// Entry point shared by `turbine-planner` and `turbine planner serve`.
pub fn main(config: PlannerConfig) -> std::process::ExitCode {
    turbine_runtime::run_service("turbine-planner", move |shutdown| async move {
        // The identity first: every client made below dials with it.
        config.server.tls.establish()?;
        let url = config.planning.database.clone().context("database: required")?;
        let ledger = Ledger::open(&url, &config.cluster.namespace).await.context("cannot open the planner's database")?;
        let cycle = match (&config.cluster.redis, &config.planning.profile) {
            (Some(url), Some(profile)) if !config.gateway_metrics.is_empty() => {
                let registry = Registry::Redis(RedisRegistry::new(url, &config.cluster.namespace).context("the worker registry")?);
                let sizing = Sizing { profile: Profile::read(profile)?, season_intervals: config.planning.season_intervals };
                Some((Observer::new(config.gateway_metrics.clone(), registry), sizing))
            }
            _ => None,
        };
        let listeners = Listeners::bind(&config.server).await?;
        tracing::info!(
            database = ledger.backend().name(),
            namespace = config.cluster.namespace,
            gateways = config.gateway_metrics.len(),
            observing = cycle.is_some(),
            "planner listening"
        );
        let connector = match config.connector {
            ConnectorKind::Virtual => Connector::Virtual,
            ConnectorKind::Local => {
                let settings = config.local_settings();
                let state_dir = settings.state_dir.display().to_string();
                Connector::Local(LocalConnector::open(settings).with_context(|| format!("the local connector's state folder {state_dir}"))?)
            }
            ConnectorKind::Hosted => anyhow::bail!("connector: hosted workers run inside turbine run (--planner)"),
            ConnectorKind::Kubernetes => kubernetes(&config).await?,
        };
        serve(config, PlannerState::with_connector(ledger, connector), cycle, listeners, shutdown).await
    })
}

/// The kubernetes connector `config` asks for.
#[cfg(feature = "kubernetes")]
async fn kubernetes(config: &PlannerConfig) -> anyhow::Result<Connector> {
    let names = crate::act::kubernetes::parse_mapping(&config.kubernetes_deployments)?;
    let connector = crate::act::kubernetes::KubernetesConnector::connect(config.kubernetes_namespace.as_deref(), names)
        .await
        .context("cannot configure the Kubernetes client (in a pod: its service account; elsewhere: KUBECONFIG or ~/.kube/config)")?;
    Ok(Connector::Kubernetes(connector))
}

#[cfg(not(feature = "kubernetes"))]
async fn kubernetes(_: &PlannerConfig) -> anyhow::Result<Connector> {
    anyhow::bail!("connector: this build has no kubernetes connector (build turbine with --features kubernetes)")
}

#[cfg(test)]
mod role_table {
    #[test]
    fn every_rpc_has_one_row_naming_who_may_call_it() {
        super::SPEC.check_roles(&[turbine_proto::service_names::PLANNER]).unwrap();
    }
}
