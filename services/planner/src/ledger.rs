//! The ledger: the planner's state in a database (PostgreSQL for the
//! service, SQLite for one machine), through `sqlx` with the embedded,
//! versioned migrations in `services/planner/migrations`. Everything the
//! planner must not lose is here: the targets, whether it is paused, every
//! decision with its inputs, and each connector action with its state, so a
//! restarted planner resumes where it stopped.
//!
//! One ledger serves one namespace; planners of several namespaces may
//! share a database.

use std::collections::HashMap;
use std::time::Duration;

use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, Row};

use crate::clock::Clock;
use crate::plan::Targets;
use crate::plan::predict::Load;
use crate::plan::{Action, ActionState, Decision, Observation};

/// The migrations, compiled into the binary (versions below 1000). A
/// database shared with the gateway's API keys table holds its migrations
/// too (from 1001): not the planner's to judge, so not checked. One of the
/// planner's own this build lacks (a newer planner's) is refused
/// ([`LedgerError::Newer`]).
pub static MIGRATOR: sqlx::migrate::Migrator = {
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.ignore_missing = true;
    migrator
};

/// Why the ledger could not answer.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The URL names no database the planner can use.
    #[error("database URL: {0}")]
    Url(String),
    /// The database refused or could not be reached.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// Migrating the schema failed.
    #[error("migrating the planner's schema: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A newer planner migrated the schema past what this build knows:
    /// its rows may mean what this build would misread.
    #[error(
        "the planner's schema in this database is at migration {found}, newer than this build's {known}: a newer planner migrated it; run that version or newer (an older one could misread or overwrite its state)"
    )]
    Newer {
        /// The newest of the planner's migrations applied.
        found: i64,
        /// The newest this build has.
        known: i64,
    },
    /// A row the ledger wrote does not read back (edited by hand, or
    /// written by a newer planner).
    #[error("row {what}: {problem}")]
    Corrupt {
        /// Which row.
        what: String,
        /// What is wrong with it.
        problem: String,
    },
}

/// Which database a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `postgres://` or `postgresql://`.
    Postgres,
    /// `sqlite:` (a file, created if missing, or `sqlite::memory:`).
    Sqlite,
}

impl Backend {
    /// The backend `url` names.
    pub fn of(url: &str) -> Result<Self, LedgerError> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Backend::Postgres)
        } else if url.starts_with("sqlite:") {
            Ok(Backend::Sqlite)
        } else {
            Err(LedgerError::Url("must start with postgres://, postgresql:// or sqlite:".into()))
        }
    }

    /// Its name, for logs.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Postgres => "postgres",
            Backend::Sqlite => "sqlite",
        }
    }
}

/// Targets and the pause switch as stored.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Control {
    /// The targets in force; `None` before the first `SetTargets`.
    pub targets: Option<Targets>,
    /// Whether acting is paused.
    pub paused: bool,
    /// Why, in the operator's words.
    pub pause_reason: String,
}

/// The planner's state of one namespace in a database.
#[derive(Debug, Clone)]
pub struct Ledger {
    pool: AnyPool,
    namespace: String,
    backend: Backend,
    clock: Clock,
}

/// Fails where the database holds a planner migration (below 1000) newer
/// than this build's newest: `ignore_missing` lets the gateway's pass, and
/// with them a newer planner's.
async fn refuse_newer(pool: &AnyPool) -> Result<(), LedgerError> {
    let known = MIGRATOR.iter().map(|migration| migration.version).max().unwrap_or(0);
    let found: Option<i64> = sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations WHERE version < 1000").fetch_one(pool).await?;
    match found {
        Some(found) if found > known => Err(LedgerError::Newer { found, known }),
        _ => Ok(()),
    }
}

/// Most decisions one history page holds (`History`'s `page_size`).
pub const MAX_PAGE: u32 = 1000;

/// How long a statement may wait for a connection.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

impl Ledger {
    /// Connects to `url` and migrates the schema to this build's version.
    pub async fn open(url: &str, namespace: &str) -> Result<Self, LedgerError> {
        let backend = Backend::of(url)?;
        sqlx::any::install_default_drivers();
        let url = match backend {
            // Create the file on first use.
            Backend::Sqlite if !url.contains("mode=") && !url.contains(":memory:") => format!("{url}{}mode=rwc", if url.contains('?') { '&' } else { '?' }),
            _ => url.to_owned(),
        };
        // SQLite has one writer; an in-memory database is per connection.
        let connections = match backend {
            Backend::Postgres => 4,
            Backend::Sqlite => 1,
        };
        let pool = AnyPoolOptions::new().max_connections(connections).acquire_timeout(ACQUIRE_TIMEOUT).connect(&url).await?;
        MIGRATOR.run(&pool).await?;
        refuse_newer(&pool).await?;
        Ok(Self { pool, namespace: namespace.to_owned(), backend, clock: Clock::System })
    }

    /// The same ledger, its records stamped by `clock`.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// The clock its records are stamped by.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Which database it is.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The namespace it keeps.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Whether the database answers.
    pub async fn ping(&self) -> Result<(), LedgerError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    /// The targets and the pause switch (defaults before anything was set).
    pub async fn control(&self) -> Result<Control, LedgerError> {
        let row = sqlx::query("SELECT targets, paused, pause_reason FROM planner_control WHERE namespace = $1")
            .bind(&self.namespace)
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = row else { return Ok(Control::default()) };
        let targets = match row.try_get::<Option<String>, _>("targets")? {
            None => None,
            Some(json) => {
                let corrupt = |problem: String| LedgerError::Corrupt { what: format!("planner_control {:?}.targets", self.namespace), problem };
                let targets: Targets = serde_json::from_str(&json).map_err(|error| corrupt(error.to_string()))?;
                Some(targets.checked().map_err(|error| corrupt(error.to_string()))?)
            }
        };
        Ok(Control { targets, paused: row.try_get::<i64, _>("paused")? != 0, pause_reason: row.try_get("pause_reason")? })
    }

    /// Stores `targets` (in force from the next interval).
    pub async fn set_targets(&self, targets: &Targets, now_unix_ms: i64) -> Result<(), LedgerError> {
        let json = serde_json::to_string(targets).expect("targets serialize");
        sqlx::query(
            "INSERT INTO planner_control (namespace, targets, targets_set_at_unix_ms, paused, pause_reason, updated_at_unix_ms) VALUES ($1, $2, $3, 0, '', $3) \
             ON CONFLICT (namespace) DO UPDATE SET targets = excluded.targets, targets_set_at_unix_ms = excluded.targets_set_at_unix_ms, updated_at_unix_ms = excluded.updated_at_unix_ms",
        )
        .bind(&self.namespace)
        .bind(json)
        .bind(now_unix_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Sets the pause switch, with the operator's reason.
    pub async fn set_paused(&self, paused: bool, reason: &str, now_unix_ms: i64) -> Result<(), LedgerError> {
        sqlx::query(
            "INSERT INTO planner_control (namespace, targets, targets_set_at_unix_ms, paused, pause_reason, updated_at_unix_ms) VALUES ($1, NULL, NULL, $2, $3, $4) \
             ON CONFLICT (namespace) DO UPDATE SET paused = excluded.paused, pause_reason = excluded.pause_reason, updated_at_unix_ms = excluded.updated_at_unix_ms",
        )
        .bind(&self.namespace)
        .bind(i64::from(paused))
        .bind(reason)
        .bind(now_unix_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The id the next decision takes: one past the newest.
    pub async fn next_decision_id(&self) -> Result<u64, LedgerError> {
        let newest: Option<i64> = sqlx::query("SELECT MAX(id) AS newest FROM planner_decisions WHERE namespace = $1")
            .bind(&self.namespace)
            .fetch_one(&self.pool)
            .await?
            .try_get("newest")?;
        Ok(newest.map_or(1, |id| id as u64 + 1))
    }

    /// Records `decision` and its actions (in the states they hold) in one
    /// transaction. Recording a decision id twice is refused by the
    /// database, and an action id already recorded keeps its state.
    pub async fn record(&self, decision: &Decision) -> Result<(), LedgerError> {
        self.insert(decision, "").await
    }

    /// Records `decision`, made while the database was unreachable, as
    /// [`Ledger::record`] does; a decision id already recorded (the write
    /// that failed had reached the database after all) keeps what it holds.
    pub async fn record_late(&self, decision: &Decision) -> Result<(), LedgerError> {
        self.insert(decision, " ON CONFLICT (namespace, id) DO NOTHING").await
    }

    async fn insert(&self, decision: &Decision, on_conflict: &str) -> Result<(), LedgerError> {
        let json = serde_json::to_string(decision).expect("decisions serialize");
        let mut transaction = self.pool.begin().await?;
        sqlx::query(&format!(
            "INSERT INTO planner_decisions (namespace, id, at_unix_ms, paused, reason, decision) VALUES ($1, $2, $3, $4, $5, $6){on_conflict}"
        ))
        .bind(&self.namespace)
        .bind(decision.id as i64)
        .bind(decision.at_unix_ms)
        .bind(i64::from(decision.paused))
        .bind(&decision.reason)
        .bind(json)
        .execute(&mut *transaction)
        .await?;
        for action in decision.pools.iter().filter_map(|pool| pool.action.as_ref()) {
            sqlx::query(
                "INSERT INTO planner_actions (id, namespace, decision_id, pool, replicas, state, message, updated_at_unix_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
                 ON CONFLICT (id) DO NOTHING",
            )
            .bind(&action.id)
            .bind(&self.namespace)
            .bind(decision.id as i64)
            .bind(&action.pool)
            .bind(i64::from(action.replicas))
            .bind(action.state.name())
            .bind(&action.message)
            .bind(decision.at_unix_ms)
            .execute(&mut *transaction)
            .await?;
        }
        transaction.commit().await?;
        Ok(())
    }

    /// Records where action `id` stands, with the connector's message.
    pub async fn set_action_state(&self, id: &str, state: ActionState, message: &str, now_unix_ms: i64) -> Result<(), LedgerError> {
        sqlx::query("UPDATE planner_actions SET state = $1, message = $2, updated_at_unix_ms = $3 WHERE id = $4 AND namespace = $5")
            .bind(state.name())
            .bind(message)
            .bind(now_unix_ms)
            .bind(id)
            .bind(&self.namespace)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Action `id` as it stands, if this namespace issued it.
    pub async fn action(&self, id: &str) -> Result<Option<Action>, LedgerError> {
        let row = sqlx::query("SELECT id, pool, replicas, state, message FROM planner_actions WHERE namespace = $1 AND id = $2")
            .bind(&self.namespace)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(action_of).transpose()
    }

    /// The actions still pending, oldest decision first.
    pub async fn pending_actions(&self) -> Result<Vec<Action>, LedgerError> {
        let rows =
            sqlx::query("SELECT id, pool, replicas, state, message FROM planner_actions WHERE namespace = $1 AND state = 'pending' ORDER BY decision_id, pool")
                .bind(&self.namespace)
                .fetch_all(&self.pool)
                .await?;
        rows.iter().map(action_of).collect()
    }

    /// Ends action `id`, if it is still pending, as `state` (done or
    /// failed) with `message`; true when it was pending. An action ends
    /// once: a second report changes nothing.
    pub async fn end_action(&self, id: &str, state: ActionState, message: &str, now_unix_ms: i64) -> Result<bool, LedgerError> {
        debug_assert_ne!(state, ActionState::Pending);
        let ended =
            sqlx::query("UPDATE planner_actions SET state = $1, message = $2, updated_at_unix_ms = $3 WHERE id = $4 AND namespace = $5 AND state = 'pending'")
                .bind(state.name())
                .bind(message)
                .bind(now_unix_ms)
                .bind(id)
                .bind(&self.namespace)
                .execute(&self.pool)
                .await?;
        Ok(ended.rows_affected() == 1)
    }

    /// Records the connector's `message` on action `id` while it is
    /// pending (an outcome reported meanwhile is kept).
    pub async fn note_pending_action(&self, id: &str, message: &str, now_unix_ms: i64) -> Result<(), LedgerError> {
        sqlx::query("UPDATE planner_actions SET message = $1, updated_at_unix_ms = $2 WHERE id = $3 AND namespace = $4 AND state = 'pending'")
            .bind(message)
            .bind(now_unix_ms)
            .bind(id)
            .bind(&self.namespace)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Up to `limit` decisions older than `before` (all when `None`),
    /// newest first, each action with its current state.
    pub async fn history(&self, before: Option<u64>, limit: usize) -> Result<Vec<Decision>, LedgerError> {
        let before = before.map_or(i64::MAX, |id| id.min(i64::MAX as u64) as i64);
        let rows = sqlx::query("SELECT id, decision FROM planner_decisions WHERE namespace = $1 AND id < $2 ORDER BY id DESC LIMIT $3")
            .bind(&self.namespace)
            .bind(before)
            .bind(limit as i64)
            .fetch_all(&self.pool)
            .await?;
        let mut decisions = rows.iter().map(|row| self.decision(row)).collect::<Result<Vec<_>, _>>()?;
        let (Some(newest), Some(oldest)) = (decisions.first(), decisions.last()) else { return Ok(decisions) };
        let states: HashMap<String, (String, String)> =
            sqlx::query("SELECT id, state, message FROM planner_actions WHERE namespace = $1 AND decision_id >= $2 AND decision_id <= $3")
                .bind(&self.namespace)
                .bind(oldest.id as i64)
                .bind(newest.id as i64)
                .fetch_all(&self.pool)
                .await?
                .iter()
                .map(|row| Ok((row.try_get("id")?, (row.try_get("state")?, row.try_get("message")?))))
                .collect::<Result<_, sqlx::Error>>()?;
        for action in decisions.iter_mut().flat_map(|decision| decision.pools.iter_mut()).filter_map(|pool| pool.action.as_mut()) {
            if let Some((state, message)) = states.get(&action.id) {
                action.state = ActionState::from_name(state).ok_or_else(|| LedgerError::Corrupt {
                    what: format!("planner_actions {:?}.state", action.id),
                    problem: format!("unknown state {state:?}"),
                })?;
                action.message.clone_from(message);
            }
        }
        Ok(decisions)
    }

    /// Records one interval's observations, ended at `at_unix_ms`; an
    /// interval already recorded keeps what it holds.
    pub async fn record_observations(&self, at_unix_ms: i64, observed: &[Observation]) -> Result<(), LedgerError> {
        let mut transaction = self.pool.begin().await?;
        for seen in observed {
            sqlx::query(
                "INSERT INTO planner_observations (namespace, at_unix_ms, pool, request_rate, isl_mean, osl_mean, ttft_ms, itl_ms, queue_depth, kv_usage, replicas, running, context_tokens, finish_rate, itl_mean_ms, token_gap_ms, started_isl_mean, served_rate, awaiting_first_token) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19) ON CONFLICT (namespace, at_unix_ms, pool) DO NOTHING",
            )
            // Not prepared once per connection: sqlx's Any driver types a
            // NULL double as float4 for Postgres, and a statement prepared
            // with a missing latency then refuses the next interval's
            // (an 8-byte double for a float4 parameter).
            .persistent(false)
            .bind(&self.namespace)
            .bind(at_unix_ms)
            .bind(&seen.pool)
            .bind(seen.load.request_rate)
            .bind(seen.load.isl_mean)
            .bind(seen.load.osl_mean)
            .bind(seen.ttft_ms)
            .bind(seen.itl_ms)
            .bind(seen.queue_depth)
            .bind(seen.kv_usage)
            .bind(i64::from(seen.replicas))
            .bind(i64::from(seen.running))
            .bind(seen.context_tokens)
            .bind(seen.finish_rate)
            .bind(seen.itl_mean_ms)
            .bind(seen.token_gap_ms)
            .bind(seen.started_isl_mean)
            .bind(seen.served_rate)
            .bind(seen.awaiting_first_token)
            .execute(&mut *transaction)
            .await?;
        }
        transaction.commit().await?;
        Ok(())
    }

    /// The newest `intervals` intervals observed, oldest first: when each
    /// ended and what each pool did.
    pub async fn observations(&self, intervals: usize) -> Result<Vec<(i64, Vec<Observation>)>, LedgerError> {
        let rows = sqlx::query(
            "SELECT at_unix_ms, pool, request_rate, isl_mean, osl_mean, ttft_ms, itl_ms, queue_depth, kv_usage, replicas, running, context_tokens, finish_rate, itl_mean_ms, token_gap_ms, started_isl_mean, served_rate, awaiting_first_token FROM planner_observations \
             WHERE namespace = $1 AND at_unix_ms >= (SELECT COALESCE(MIN(at), 0) FROM (SELECT DISTINCT at_unix_ms AS at FROM planner_observations WHERE namespace = $1 ORDER BY at DESC LIMIT $2) AS recent) \
             ORDER BY at_unix_ms, pool",
        )
        .bind(&self.namespace)
        .bind(intervals as i64)
        .fetch_all(&self.pool)
        .await?;
        let mut history: Vec<(i64, Vec<Observation>)> = Vec::new();
        for row in rows {
            let at: i64 = row.try_get("at_unix_ms")?;
            let seen = Observation {
                pool: row.try_get("pool")?,
                load: Load { request_rate: row.try_get("request_rate")?, isl_mean: row.try_get("isl_mean")?, osl_mean: row.try_get("osl_mean")? },
                ttft_ms: row.try_get("ttft_ms")?,
                itl_ms: row.try_get("itl_ms")?,
                queue_depth: row.try_get("queue_depth")?,
                kv_usage: row.try_get("kv_usage")?,
                replicas: u32::try_from(row.try_get::<i64, _>("replicas")?).unwrap_or(0),
                running: u32::try_from(row.try_get::<i64, _>("running")?).unwrap_or(0),
                context_tokens: row.try_get("context_tokens")?,
                finish_rate: row.try_get("finish_rate")?,
                itl_mean_ms: row.try_get("itl_mean_ms")?,
                token_gap_ms: row.try_get("token_gap_ms")?,
                started_isl_mean: row.try_get("started_isl_mean")?,
                served_rate: row.try_get("served_rate")?,
                awaiting_first_token: row.try_get("awaiting_first_token")?,
            };
            match history.last_mut() {
                Some((last, pools)) if *last == at => pools.push(seen),
                _ => history.push((at, vec![seen])),
            }
        }
        Ok(history)
    }

    /// When `pool` was last scaled: the newest decision with an action on
    /// it that did not fail (ms since the epoch).
    pub async fn last_scaled(&self, pool: &str) -> Result<Option<i64>, LedgerError> {
        let row = sqlx::query(
            "SELECT MAX(d.at_unix_ms) AS at FROM planner_actions a JOIN planner_decisions d ON d.namespace = a.namespace AND d.id = a.decision_id \
             WHERE a.namespace = $1 AND a.pool = $2 AND a.state <> 'failed'",
        )
        .bind(&self.namespace)
        .bind(pool)
        .fetch_one(&self.pool)
        .await?;
        Ok(row.try_get("at")?)
    }

    /// The newest decision, if any.
    pub async fn latest(&self) -> Result<Option<Decision>, LedgerError> {
        Ok(self.history(None, 1).await?.into_iter().next())
    }

    fn decision(&self, row: &AnyRow) -> Result<Decision, LedgerError> {
        let id: i64 = row.try_get("id")?;
        let json: String = row.try_get("decision")?;
        serde_json::from_str(&json)
            .map_err(|error| LedgerError::Corrupt { what: format!("planner_decisions ({:?}, {id})", self.namespace), problem: error.to_string() })
    }
}

/// An action as a `planner_actions` row holds it.
fn action_of(row: &AnyRow) -> Result<Action, LedgerError> {
    let id: String = row.try_get("id")?;
    let state: String = row.try_get("state")?;
    let corrupt = |problem: String| LedgerError::Corrupt { what: format!("planner_actions {id:?}"), problem };
    Ok(Action {
        pool: row.try_get("pool")?,
        replicas: u32::try_from(row.try_get::<i64, _>("replicas")?).map_err(|error| corrupt(format!("replicas: {error}")))?,
        state: ActionState::from_name(&state).ok_or_else(|| corrupt(format!("unknown state {state:?}")))?,
        message: row.try_get("message")?,
        id: id.clone(),
    })
}
