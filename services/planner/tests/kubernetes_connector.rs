//! The `kubernetes` connector against a stand-in API server on loopback
//! (no API server runs here): it answers in the recorded shapes of
//! `fixtures/kubernetes/` and checks every request the planner sends, as
//! the API server would (path, merge patch, field manager, body). An
//! action scales the pool's Deployment once, by id; a pool counts the
//! replicas the scale reports; a missing Deployment, missing RBAC and an
//! API server that does not answer fail the action, saying what to fix.
#![cfg(feature = "kubernetes")]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use serde_json::Value;
use turbine_planner::act::connector::{self, Connector, Outcome};
use turbine_planner::act::kubernetes::{KubernetesConnector, MappingError, parse_mapping};
use turbine_planner::{Action, ActionState, Decision, Ledger, PlannerState, PoolDecision};

const NAMESPACE: &str = "turbine";

fn fixture(name: &str, deployment: &str, pool: &str) -> Value {
    let path = format!("{}/tests/fixtures/kubernetes/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(path).unwrap().replace("NAMESPACE", NAMESPACE).replace("NAME", deployment).replace("POOL", pool);
    serde_json::from_str(&text).unwrap()
}

/// A request as the stand-in received it.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    method: &'static str,
    path: String,
    /// The query's parameters, as the API server reads them (empty ones
    /// dropped).
    query: Vec<String>,
    content_type: String,
    body: Value,
}

#[derive(Debug, Default)]
struct Cluster {
    /// Deployment → replicas.
    replicas: BTreeMap<String, i32>,
    seen: Vec<Seen>,
}

type Shared = Arc<Mutex<Cluster>>;

fn parameters(query: Option<String>) -> Vec<String> {
    query.unwrap_or_default().split('&').filter(|parameter| !parameter.is_empty()).map(str::to_owned).collect()
}

/// The answer for `deployment`: its Scale, or the API server's Status.
fn answer(cluster: &Cluster, namespace: &str, deployment: &str) -> (StatusCode, axum::Json<Value>) {
    if namespace != NAMESPACE {
        return (StatusCode::NOT_FOUND, axum::Json(fixture("not-found.json", deployment, "")));
    }
    if deployment == "turbine-worker-locked" {
        return (StatusCode::FORBIDDEN, axum::Json(fixture("forbidden.json", deployment, "")));
    }
    match cluster.replicas.get(deployment) {
        Some(&replicas) => {
            let pool = deployment.trim_start_matches("turbine-worker-");
            let mut scale = fixture("scale.json", deployment, pool);
            scale["spec"]["replicas"] = replicas.into();
            scale["status"]["replicas"] = replicas.into();
            (StatusCode::OK, axum::Json(scale))
        }
        None => (StatusCode::NOT_FOUND, axum::Json(fixture("not-found.json", deployment, ""))),
    }
}

async fn get_scale(
    State(cluster): State<Shared>,
    Path((namespace, deployment)): Path<(String, String)>,
    RawQuery(query): RawQuery,
) -> (StatusCode, axum::Json<Value>) {
    let mut cluster = cluster.lock().unwrap();
    let path = format!("/apis/apps/v1/namespaces/{namespace}/deployments/{deployment}/scale");
    cluster.seen.push(Seen { method: "GET", path, query: parameters(query), content_type: String::new(), body: Value::Null });
    answer(&cluster, &namespace, &deployment)
}

async fn patch_scale(
    State(cluster): State<Shared>,
    Path((namespace, deployment)): Path<(String, String)>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: String,
) -> (StatusCode, axum::Json<Value>) {
    let mut cluster = cluster.lock().unwrap();
    let content_type = headers.get("content-type").and_then(|value| value.to_str().ok()).unwrap_or_default().to_owned();
    let body: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    let path = format!("/apis/apps/v1/namespaces/{namespace}/deployments/{deployment}/scale");
    cluster.seen.push(Seen { method: "PATCH", path, query: parameters(query), content_type: content_type.clone(), body: body.clone() });
    // What the API server refuses: another patch type, a body that is not
    // a scale's replicas.
    if content_type != "application/merge-patch+json" {
        return (StatusCode::UNSUPPORTED_MEDIA_TYPE, axum::Json(Value::Null));
    }
    let replicas = body.pointer("/spec/replicas").and_then(Value::as_i64);
    let only_replicas = body.as_object().is_some_and(|object| object.len() == 1) && body["spec"].as_object().is_some_and(|spec| spec.len() == 1);
    let (code, json) = answer(&cluster, &namespace, &deployment);
    match replicas {
        Some(replicas) if code == StatusCode::OK && only_replicas && replicas >= 0 => {
            cluster.replicas.insert(deployment.clone(), replicas as i32);
            answer(&cluster, &namespace, &deployment)
        }
        Some(_) if code != StatusCode::OK => (code, json),
        _ => (StatusCode::UNPROCESSABLE_ENTITY, axum::Json(Value::Null)),
    }
}

/// The stand-in API server with `deployments` at their replicas; its URL.
async fn api_server(deployments: &[(&str, i32)]) -> (String, Shared) {
    let cluster: Shared =
        Arc::new(Mutex::new(Cluster { replicas: deployments.iter().map(|(name, replicas)| ((*name).to_owned(), *replicas)).collect(), seen: Vec::new() }));
    let app = axum::Router::new()
        .route("/apis/apps/v1/namespaces/{namespace}/deployments/{deployment}/scale", get(get_scale).patch(patch_scale))
        .with_state(cluster.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, cluster)
}

fn connector(url: &str, mappings: &[&str]) -> KubernetesConnector {
    let config = kube::Config::new(url.parse().unwrap());
    let client = kube::Client::try_from(config).unwrap();
    let names = parse_mapping(&mappings.iter().map(|mapping| (*mapping).to_owned()).collect::<Vec<_>>()).unwrap();
    KubernetesConnector::new(client, Some(NAMESPACE), names)
}

fn action(id: &str, pool: &str, replicas: u32) -> Action {
    Action { id: id.into(), pool: pool.into(), replicas, state: ActionState::Pending, message: String::new() }
}

#[tokio::test]
async fn an_action_patches_the_pools_deployment_scale_once() {
    let (url, cluster) = api_server(&[("turbine-worker-decode", 2), ("llama-prefill", 1)]).await;
    let kubernetes = connector(&url, &["prefill=llama-prefill"]);

    let outcome = kubernetes.execute(&action("default/7/decode", "decode", 5)).await;
    assert_eq!(outcome, Outcome::Done("Deployment turbine/turbine-worker-decode scaled to 5 replicas (5 running)".into()));
    let patch = cluster.lock().unwrap().seen.last().cloned().unwrap();
    assert_eq!(
        patch,
        Seen {
            method: "PATCH",
            path: "/apis/apps/v1/namespaces/turbine/deployments/turbine-worker-decode/scale".into(),
            query: vec!["fieldManager=turbine-planner".to_owned()],
            content_type: "application/merge-patch+json".into(),
            body: serde_json::json!({"spec": {"replicas": 5}}),
        }
    );

    // The same id again (a restart handing it over): answered, not sent.
    let requests = cluster.lock().unwrap().seen.len();
    assert_eq!(kubernetes.execute(&action("default/7/decode", "decode", 5)).await, outcome);
    assert_eq!(cluster.lock().unwrap().seen.len(), requests);

    // A pool counts what the scale reports; a mapped pool is its Deployment.
    assert_eq!(kubernetes.serving("decode").await, Some(5));
    assert_eq!(kubernetes.serving("prefill").await, Some(1));
    kubernetes.execute(&action("default/8/prefill", "prefill", 0)).await;
    assert_eq!(cluster.lock().unwrap().replicas["llama-prefill"], 0, "scaled to zero");
    assert_eq!(cluster.lock().unwrap().seen.last().unwrap().path, "/apis/apps/v1/namespaces/turbine/deployments/llama-prefill/scale");
}

#[tokio::test]
async fn a_missing_deployment_missing_rbac_or_no_api_server_fail_the_action_saying_why() {
    let (url, _cluster) = api_server(&[("turbine-worker-decode", 2)]).await;
    let kubernetes = connector(&url, &[]);

    let Outcome::Failed(missing) = kubernetes.execute(&action("default/1/workers", "workers", 3)).await else { panic!("no Deployment, no success") };
    assert!(missing.contains("turbine/turbine-worker-workers") && missing.contains("404") && missing.contains("--kubernetes-deployments"), "{missing}");
    let Outcome::Failed(forbidden) = kubernetes.execute(&action("default/1/locked", "locked", 3)).await else { panic!("forbidden, no success") };
    assert!(forbidden.contains("403") && forbidden.contains("deployments/scale"), "{forbidden}");
    assert_eq!(kubernetes.serving("workers").await, None, "an unknown count, not zero");

    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gone = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let unreachable = connector(&gone, &[]);
    assert!(matches!(unreachable.execute(&action("default/2/decode", "decode", 3)).await, Outcome::Failed(_)));
    assert_eq!(unreachable.serving("decode").await, None);
}

#[tokio::test]
async fn the_planner_records_how_each_kubernetes_action_ended() {
    let (url, cluster) = api_server(&[("turbine-worker-decode", 2)]).await;
    let folder = tempfile::tempdir().unwrap();
    let database = format!("sqlite:{}", folder.path().join("planner.db").display());
    let state = PlannerState::with_connector(Ledger::open(&database, "default").await.unwrap(), Connector::Kubernetes(connector(&url, &[])));
    for (id, pool, replicas) in [(1, "decode", 4), (2, "gone", 1)] {
        let action = Action { id: Action::id_for("default", id, pool), ..action("", pool, replicas) };
        let decision = Decision {
            id,
            at_unix_ms: 1_764_000_000_000 + id as i64 * 30_000,
            observed: Vec::new(),
            predicted: None,
            pools: vec![PoolDecision {
                pool: pool.into(),
                current_replicas: 2,
                proposed_replicas: replicas,
                desired_replicas: replicas,
                reason: "test".into(),
                action: Some(action.clone()),
            }],
            reason: "test".into(),
            paused: false,
        };
        state.record(decision).await.unwrap();
        connector::execute(state.ledger(), state.connector(), std::slice::from_ref(&action)).await.unwrap();
    }
    let scaled = state.ledger().action(&Action::id_for("default", 1, "decode")).await.unwrap().unwrap();
    assert_eq!((scaled.state, cluster.lock().unwrap().replicas["turbine-worker-decode"]), (ActionState::Done, 4), "{}", scaled.message);
    let failed = state.ledger().action(&Action::id_for("default", 2, "gone")).await.unwrap().unwrap();
    assert_eq!(failed.state, ActionState::Failed);
    assert!(failed.message.contains("404"), "{}", failed.message);
}

#[test]
fn mappings_are_pool_equals_a_deployment_name() {
    let parse = |mappings: &[&str]| parse_mapping(&mappings.iter().map(|mapping| (*mapping).to_owned()).collect::<Vec<_>>());
    assert_eq!(parse(&["decode=llama-decode"]).unwrap()["decode"], "llama-decode");
    for bad in [&["decode=Llama"][..], &["=x"], &["decode=-x"]] {
        assert!(matches!(parse(bad), Err(MappingError::BadName(_))), "{bad:?}");
    }
    assert_eq!(parse(&["decode"]), Err(MappingError::NotAPair("decode".into())));
    assert_eq!(parse(&["decode=a", "decode=b"]), Err(MappingError::Twice("decode".into())));
}
