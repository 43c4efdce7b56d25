//! API keys kept in a database (`--api-keys-database`): PostgreSQL for a
//! deployment (its gateways read the same rows, so a key added or revoked
//! once holds at every gateway), SQLite for one machine. The table is the
//! gateway's own, migrated by [`MIGRATOR`] (versions from 1001, beside the
//! planner's below 1000 when they share a database).
//!
//! Who writes: operators (`turbine keys new|revoke --database`, holding the
//! database's credentials: [`KeyTable::open`]). Gateways only read, and
//! only the rows of their namespace ([`KeyTable::open_to_read`]): over
//! sessions the database itself holds read-only, needing no more of their
//! credentials than `SELECT` on the table. A row holds a key's SHA-256 digest, never the key. A revoked
//! key's row stays (with when it was revoked), and its name stays taken.
//!
//! On PostgreSQL a trigger announces every change ([`CHANGES_CHANNEL`]):
//! the gateways listen, and read their keys again at once
//! ([`KeyTable::listen`]).

use std::time::Duration;

use sqlx::any::AnyPoolOptions;
use sqlx::{AnyPool, Executor, Row};

use super::{ApiKeys, KeySpec, digest_hex, now_unix_ms};

/// The gateway's migrations, compiled into the binary. Applied migrations
/// of another service sharing the database (the planner's) are not ours to
/// judge, so they are not checked.
pub static MIGRATOR: sqlx::migrate::Migrator = {
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.ignore_missing = true;
    migrator
};

/// PostgreSQL's alone, beside [`MIGRATOR`] (numbered from 1101): the
/// trigger announcing each change to the table on [`CHANGES_CHANNEL`].
pub static POSTGRES_MIGRATOR: sqlx::migrate::Migrator = {
    let mut migrator = sqlx::migrate!("./migrations-postgres");
    migrator.ignore_missing = true;
    migrator
};

/// Where PostgreSQL announces a change to the table, its payload the
/// namespace changed (`""`: every one).
pub const CHANGES_CHANNEL: &str = "gateway_api_keys";

/// How long a statement may wait for a connection.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// A key to store: what the gateway needs of it, beside its digest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyEntry {
    /// In logs and metrics; unique in the namespace.
    pub name: String,
    /// Whose prompt cache its requests use.
    pub tenant: String,
    /// A prompt cache shared by every key naming it, instead of the
    /// tenant's own.
    pub share_prefixes: Option<String>,
    /// Requests a minute.
    pub requests_per_minute: Option<u32>,
    /// Tokens (prompt and completion) a minute.
    pub tokens_per_minute: Option<u64>,
    /// Requests in flight at once.
    pub max_concurrent: Option<u32>,
    /// When it stops authenticating (Unix milliseconds).
    pub expires_at_unix_ms: Option<i64>,
}

/// A key as stored (`turbine keys list`): never the key itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredKey {
    /// What it was stored with.
    pub entry: KeyEntry,
    /// Its digest, hex.
    pub sha256: String,
    /// When it was stored (Unix milliseconds).
    pub created_at_unix_ms: i64,
    /// When it was revoked, if it was.
    pub revoked_at_unix_ms: Option<i64>,
}

/// Why a key could not be stored or revoked.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// The entry would not authenticate anyone as asked.
    #[error("{0}")]
    Invalid(String),
    /// Another key of the namespace has the name (revoked keys keep
    /// theirs).
    #[error("the namespace {namespace:?} already has a key named {name:?} (a revoked key keeps its name): choose another")]
    NameTaken {
        /// The namespace.
        namespace: String,
        /// The name.
        name: String,
    },
    /// No key in force has the name.
    #[error("the namespace {namespace:?} has no key in force named {name:?}")]
    NotFound {
        /// The namespace.
        namespace: String,
        /// The name.
        name: String,
    },
    /// The database refused or could not be reached.
    #[error("the API keys database ({url}): {source}")]
    Database {
        /// Where, its password left out.
        url: String,
        /// What it said.
        source: sqlx::Error,
    },
    /// Migrating the table failed.
    #[error("migrating the API keys table ({url}): {source}")]
    Migrate {
        /// Where, its password left out.
        url: String,
        /// What it said.
        source: sqlx::migrate::MigrateError,
    },
    /// A gateway found no table it can read, and its credentials may not
    /// make one.
    #[error(
        "the API keys table ({url}) cannot be read ({read}) and cannot be made with these credentials ({source}): make or migrate it with `turbine keys list --database` (any `turbine keys` command on the database) under credentials that may, and let the gateway's read it (GRANT SELECT ON gateway_api_keys; docs/operations.md)"
    )]
    Unmade {
        /// Where, its password left out.
        url: String,
        /// Why it could not be read.
        read: String,
        /// Why it could not be made.
        source: sqlx::migrate::MigrateError,
    },
    /// Keys are stored and revoked by operators, not through a gateway's
    /// read-only table.
    #[error("the API keys table ({0}) was opened to read: keys are added and revoked with `turbine keys`")]
    ReadOnly(String),
    /// A row does not read back as a key (edited by hand).
    #[error("the API keys table ({url}) holds a row that is no key: {problem}")]
    Corrupt {
        /// Where.
        url: String,
        /// What is wrong with it.
        problem: String,
    },
}

/// The API keys of one namespace in a database.
#[derive(Clone)]
pub struct KeyTable {
    pool: AnyPool,
    namespace: String,
    url: String,
    /// Opened by a gateway ([`KeyTable::open_to_read`]).
    read_only: bool,
    /// PostgreSQL's URL, where its changes are announced once its
    /// trigger is made ([`listen`](Self::listen)).
    postgres_url: Option<String>,
}

impl std::fmt::Debug for KeyTable {
    /// Without the URL's password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyTable")
            .field("url", &self.url)
            .field("namespace", &self.namespace)
            .field("read_only", &self.read_only)
            .field("may_announce_changes", &self.may_announce_changes())
            .finish_non_exhaustive()
    }
}

/// What is read of a row.
const COLUMNS: &str =
    "name, tenant, sha256, share_prefixes, requests_per_minute, tokens_per_minute, max_concurrent, expires_at_unix_ms, created_at_unix_ms, revoked_at_unix_ms";

/// `url` with its password left out, for logs and errors.
pub fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => {
            let user = rest[..at].split(':').next().unwrap_or_default();
            format!("{scheme}://{user}:***@{}", &rest[at + 1..])
        }
        None => url.to_owned(),
    }
}

impl KeyTable {
    /// Connects to `url` (`postgres://…`, `sqlite:FILE`) and makes or
    /// migrates the table; the keys of `namespace`, to add, revoke and
    /// list (`turbine keys`).
    pub async fn open(url: &str, namespace: &str) -> Result<Self, TableError> {
        let table = Self::connect(url, namespace, false).await?;
        table.migrate().await.map_err(|source| TableError::Migrate { url: table.url.clone(), source })?;
        Ok(table)
    }

    /// Makes or migrates the table, and on PostgreSQL its trigger.
    async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
        MIGRATOR.run(&self.pool).await?;
        if !self.url.starts_with("sqlite:") {
            POSTGRES_MIGRATOR.run(&self.pool).await?;
        }
        Ok(())
    }

    /// A gateway's: the keys of `namespace` to read, over sessions the
    /// database holds read-only (`default_transaction_read_only`, SQLite's
    /// `query_only`), so its credentials need no more than `SELECT` on the
    /// table. Only where the table is missing or older than this build
    /// reads is it made or migrated first, which needs credentials that
    /// may (those `turbine keys` uses; else [`TableError::Unmade`]).
    pub async fn open_to_read(url: &str, namespace: &str) -> Result<Self, TableError> {
        if url.starts_with("sqlite:") && url.contains(":memory:") {
            return Err(TableError::Invalid(format!(
                "{url}: an in-memory database lives and dies with one process, so no operator could add a key to it: name a file"
            )));
        }
        let mut table = Self::connect(url, namespace, true).await?;
        if let Err(read) = table.columns().await {
            let maker = Self::connect(url, namespace, false).await?;
            let made = maker.migrate().await;
            maker.pool.close().await;
            if let Err(source) = made {
                return Err(TableError::Unmade { url: table.url.clone(), read: read.to_string(), source });
            }
            table.columns().await.map_err(table.database())?;
        }
        if !url.starts_with("sqlite:") {
            if !table.announcing().await.map_err(table.database())? {
                // A table made before its trigger: made now where these
                // credentials may; else read at every reload until it is
                // made (`listen` finds it).
                let maker = Self::connect(url, namespace, false).await?;
                if let Err(error) = POSTGRES_MIGRATOR.run(&maker.pool).await {
                    tracing::warn!(
                        database = table.url(),
                        %error,
                        "the API keys table announces no change (its trigger is missing and these credentials may not make it): a key revoked is refused here only from the next --api-keys-reload-secs; run any `turbine keys` command on the database to make it"
                    );
                }
                maker.pool.close().await;
            }
            table.postgres_url = Some(url.to_owned());
        }
        Ok(table)
    }

    /// Whether PostgreSQL's trigger announcing the table's changes is
    /// there.
    async fn announcing(&self) -> Result<bool, sqlx::Error> {
        let found = sqlx::query("SELECT 1 FROM pg_trigger WHERE tgname = 'gateway_api_keys_announce' AND tgrelid = 'gateway_api_keys'::regclass")
            .fetch_optional(&self.pool)
            .await?;
        Ok(found.is_some())
    }

    /// Whether the table may announce its changes (PostgreSQL's;
    /// [`listen`](Self::listen)).
    pub fn may_announce_changes(&self) -> bool {
        self.postgres_url.is_some()
    }

    /// A connection hearing each change to the table as it is committed
    /// (PostgreSQL, [`CHANGES_CHANNEL`]); when lost, `try_recv` answers
    /// `None` once, then connects and listens again (sqlx's `PgListener`).
    /// Refused while the table's trigger is missing: nothing would be
    /// heard.
    pub async fn listen(&self) -> Result<sqlx::postgres::PgListener, TableError> {
        let Some(url) = &self.postgres_url else {
            return Err(TableError::Invalid(format!("{}: this table announces no change (only PostgreSQL's does)", self.url)));
        };
        if !self.announcing().await.map_err(self.database())? {
            return Err(TableError::Invalid(format!(
                "{}: the API keys table announces no change: its trigger is missing (run any `turbine keys` command on the database to make it)",
                self.url
            )));
        }
        // Its connection waited for no longer than a statement's, and
        // lost without reconnecting at once: the loss is told first
        // (`try_recv` answers `None`), so the keys are read for what may
        // go unheard, and the next `try_recv` connects again.
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).acquire_timeout(ACQUIRE_TIMEOUT).connect(url).await.map_err(self.database())?;
        let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await.map_err(self.database())?;
        listener.eager_reconnect(false);
        listener.listen(CHANGES_CHANNEL).await.map_err(self.database())?;
        Ok(listener)
    }

    async fn connect(url: &str, namespace: &str, read_only: bool) -> Result<Self, TableError> {
        let shown = redacted(url);
        let sqlite = url.starts_with("sqlite:");
        if !sqlite && !url.starts_with("postgres://") && !url.starts_with("postgresql://") {
            return Err(TableError::Invalid(format!("{shown}: the API keys database must be postgres://, postgresql:// or sqlite:")));
        }
        sqlx::any::install_default_drivers();
        let connect = match sqlite {
            // The file is made on first use.
            true if !url.contains("mode=") && !url.contains(":memory:") => format!("{url}{}mode=rwc", if url.contains('?') { '&' } else { '?' }),
            _ => url.to_owned(),
        };
        // Read-only sessions: the database refuses this pool any write,
        // whatever the credentials may.
        let session = match (read_only, sqlite) {
            (false, _) => None,
            (true, true) => Some("PRAGMA query_only = ON"),
            (true, false) => Some("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY"),
        };
        // SQLite has one writer; an in-memory database is per connection.
        let pool = AnyPoolOptions::new()
            .max_connections(if sqlite { 1 } else { 2 })
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .after_connect(move |connection, _| {
                Box::pin(async move {
                    if let Some(session) = session {
                        connection.execute(session).await?;
                    }
                    Ok(())
                })
            })
            .connect(&connect)
            .await
            .map_err(|source| TableError::Database { url: shown.clone(), source })?;
        Ok(Self { pool, namespace: namespace.to_owned(), url: shown, read_only, postgres_url: None })
    }

    /// Reads no row, but every column this build reads: fails where the
    /// table is missing or older.
    async fn columns(&self) -> Result<(), sqlx::Error> {
        sqlx::query(&format!("SELECT {COLUMNS} FROM gateway_api_keys WHERE 1 = 0")).fetch_all(&self.pool).await.map(drop)
    }

    /// Where it is, its password left out.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The namespace whose keys it holds.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn writable(&self) -> Result<(), TableError> {
        match self.read_only {
            true => Err(TableError::ReadOnly(self.url.clone())),
            false => Ok(()),
        }
    }

    fn database(&self) -> impl Fn(sqlx::Error) -> TableError + '_ {
        |source| TableError::Database { url: self.url.clone(), source }
    }

    /// Stores `entry` for `key` (its digest only), checked as the gateway
    /// will read it.
    pub async fn add(&self, entry: &KeyEntry, key: &str) -> Result<(), TableError> {
        self.writable()?;
        let spec = KeySpec {
            name: entry.name.clone(),
            tenant: entry.tenant.clone(),
            sha256: digest_hex(key),
            share_prefixes: entry.share_prefixes.clone(),
            requests_per_minute: entry.requests_per_minute,
            tokens_per_minute: entry.tokens_per_minute,
            max_concurrent: entry.max_concurrent,
            expires_at_unix_ms: entry.expires_at_unix_ms,
        };
        ApiKeys::from_specs(vec![spec.clone()]).map_err(TableError::Invalid)?;
        let taken = sqlx::query("SELECT 1 FROM gateway_api_keys WHERE namespace = $1 AND name = $2")
            .bind(&self.namespace)
            .bind(&spec.name)
            .fetch_optional(&self.pool)
            .await
            .map_err(self.database())?;
        let name_taken = || TableError::NameTaken { namespace: self.namespace.clone(), name: spec.name.clone() };
        if taken.is_some() {
            return Err(name_taken());
        }
        let inserted = sqlx::query(
            "INSERT INTO gateway_api_keys (namespace, name, tenant, sha256, share_prefixes, requests_per_minute, tokens_per_minute, max_concurrent, expires_at_unix_ms, created_at_unix_ms, revoked_at_unix_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, NULL)",
        )
        .bind(&self.namespace)
        .bind(&spec.name)
        .bind(&spec.tenant)
        .bind(&spec.sha256)
        .bind(spec.share_prefixes.clone())
        .bind(spec.requests_per_minute.map(i64::from))
        .bind(spec.tokens_per_minute.map(|tokens| tokens.min(i64::MAX as u64) as i64))
        .bind(spec.max_concurrent.map(i64::from))
        .bind(spec.expires_at_unix_ms)
        .bind(now_unix_ms())
        .execute(&self.pool)
        .await;
        match inserted {
            Ok(_) => Ok(()),
            // Stored by another operator since the check above.
            Err(sqlx::Error::Database(error)) if error.is_unique_violation() => Err(name_taken()),
            Err(error) => Err(self.database()(error)),
        }
    }

    /// Revokes the key in force named `name`: every gateway refuses it
    /// once it reads the table again (on PostgreSQL at once, the change
    /// announced).
    pub async fn revoke(&self, name: &str) -> Result<(), TableError> {
        self.writable()?;
        let done = sqlx::query("UPDATE gateway_api_keys SET revoked_at_unix_ms = $3 WHERE namespace = $1 AND name = $2 AND revoked_at_unix_ms IS NULL")
            .bind(&self.namespace)
            .bind(name)
            .bind(now_unix_ms())
            .execute(&self.pool)
            .await
            .map_err(self.database())?;
        if done.rows_affected() == 0 {
            return Err(TableError::NotFound { namespace: self.namespace.clone(), name: name.to_owned() });
        }
        Ok(())
    }

    /// Every key of the namespace, revoked ones too, by name.
    pub async fn list(&self) -> Result<Vec<StoredKey>, TableError> {
        let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM gateway_api_keys WHERE namespace = $1 ORDER BY name"))
            .bind(&self.namespace)
            .fetch_all(&self.pool)
            .await
            .map_err(self.database())?;
        rows.iter().map(|row| self.stored(row)).collect()
    }

    fn stored(&self, row: &sqlx::any::AnyRow) -> Result<StoredKey, TableError> {
        let corrupt = |problem: String| TableError::Corrupt { url: self.url.clone(), problem };
        let read = |error: sqlx::Error| corrupt(error.to_string());
        let name: String = row.try_get("name").map_err(read)?;
        let limit = |column: &str| -> Result<Option<i64>, TableError> {
            match row.try_get::<Option<i64>, _>(column).map_err(read)? {
                Some(value) if value <= 0 => Err(corrupt(format!("key {name:?}: {column} {value} is not positive"))),
                other => Ok(other),
            }
        };
        let narrow = |value: Option<i64>, column: &str| -> Result<Option<u32>, TableError> {
            value.map(|value| u32::try_from(value).map_err(|_| corrupt(format!("key {name:?}: {column} {value} is too large")))).transpose()
        };
        let entry = KeyEntry {
            tenant: row.try_get("tenant").map_err(read)?,
            share_prefixes: row.try_get("share_prefixes").map_err(read)?,
            requests_per_minute: narrow(limit("requests_per_minute")?, "requests_per_minute")?,
            tokens_per_minute: limit("tokens_per_minute")?.map(|tokens| tokens as u64),
            max_concurrent: narrow(limit("max_concurrent")?, "max_concurrent")?,
            expires_at_unix_ms: row.try_get("expires_at_unix_ms").map_err(read)?,
            name: name.clone(),
        };
        Ok(StoredKey {
            entry,
            sha256: row.try_get("sha256").map_err(read)?,
            created_at_unix_ms: row.try_get("created_at_unix_ms").map_err(read)?,
            revoked_at_unix_ms: row.try_get("revoked_at_unix_ms").map_err(read)?,
        })
    }

    /// The keys in force (not revoked), as the gateway reads them (those
    /// past their expiry too: the gateway tells their holders so).
    pub(super) async fn in_force(&self) -> Result<Vec<KeySpec>, TableError> {
        Ok(self
            .list()
            .await?
            .into_iter()
            .filter(|key| key.revoked_at_unix_ms.is_none())
            .map(|key| KeySpec {
                name: key.entry.name,
                tenant: key.entry.tenant,
                sha256: key.sha256,
                share_prefixes: key.entry.share_prefixes,
                requests_per_minute: key.entry.requests_per_minute,
                tokens_per_minute: key.entry.tokens_per_minute,
                max_concurrent: key.entry.max_concurrent,
                expires_at_unix_ms: key.entry.expires_at_unix_ms,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn table(dir: &tempfile::TempDir, namespace: &str) -> KeyTable {
        KeyTable::open(&format!("sqlite:{}", dir.path().join("keys.sqlite").display()), namespace).await.unwrap()
    }

    #[tokio::test]
    async fn keys_are_stored_as_digests_revoked_in_place_and_kept_per_namespace() {
        let dir = tempfile::tempdir().unwrap();
        let (prod, staging) = (table(&dir, "prod").await, table(&dir, "staging").await);
        let entry = KeyEntry {
            name: "acme".into(),
            tenant: "acme".into(),
            requests_per_minute: Some(60),
            expires_at_unix_ms: Some(1_798_761_600_000),
            ..KeyEntry::default()
        };
        prod.add(&entry, "tk_one").await.unwrap();
        staging.add(&KeyEntry { name: "acme".into(), tenant: "other".into(), ..KeyEntry::default() }, "tk_two").await.unwrap();

        let listed = prod.list().await.unwrap();
        assert_eq!(listed.len(), 1, "{listed:?}");
        assert_eq!((&listed[0].entry, listed[0].sha256.as_str(), listed[0].revoked_at_unix_ms), (&entry, digest_hex("tk_one").as_str(), None));
        assert!(!format!("{listed:?}").contains("tk_one"), "the key is never stored");
        assert_eq!(prod.in_force().await.unwrap()[0].tenant, "acme");
        assert_eq!(staging.in_force().await.unwrap()[0].tenant, "other", "another namespace's key of the same name");

        assert!(matches!(prod.add(&entry, "tk_three").await, Err(TableError::NameTaken { .. })));
        prod.revoke("acme").await.unwrap();
        assert!(prod.in_force().await.unwrap().is_empty());
        assert!(prod.list().await.unwrap()[0].revoked_at_unix_ms.is_some(), "the row stays, revoked");
        assert!(matches!(prod.revoke("acme").await, Err(TableError::NotFound { .. })), "revoked once");
        assert!(matches!(prod.add(&entry, "tk_four").await, Err(TableError::NameTaken { .. })), "a revoked key keeps its name");
        assert_eq!(staging.in_force().await.unwrap().len(), 1, "untouched by the other namespace's revocation");

        for bad in [
            KeyEntry { name: String::new(), tenant: "t".into(), ..KeyEntry::default() },
            KeyEntry { name: "n".into(), tenant: "t".into(), max_concurrent: Some(0), ..KeyEntry::default() },
            KeyEntry { name: "n".into(), tenant: "t".into(), share_prefixes: Some(" ".into()), ..KeyEntry::default() },
        ] {
            assert!(matches!(prod.add(&bad, "tk_five").await, Err(TableError::Invalid(_))), "{bad:?}");
        }
    }

    /// A gateway's table reads what operators store and can write nothing,
    /// its sessions refused any write by the database itself; on a new
    /// file it makes the table first.
    #[tokio::test]
    async fn a_gateway_reads_the_keys_and_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite:{}", dir.path().join("keys.sqlite").display());
        let gateway = KeyTable::open_to_read(&url, "prod").await.expect("made on first use");
        assert!(gateway.in_force().await.unwrap().is_empty());
        let operator = KeyTable::open(&url, "prod").await.unwrap();
        let entry = KeyEntry { name: "acme".into(), tenant: "acme".into(), ..KeyEntry::default() };
        operator.add(&entry, "tk_one").await.unwrap();
        assert_eq!(gateway.in_force().await.unwrap()[0].sha256, digest_hex("tk_one"));

        assert!(matches!(gateway.add(&KeyEntry { name: "mine".into(), ..entry.clone() }, "tk_two").await, Err(TableError::ReadOnly(_))));
        assert!(matches!(gateway.revoke("acme").await, Err(TableError::ReadOnly(_))));
        for write in [
            "UPDATE gateway_api_keys SET revoked_at_unix_ms = 1",
            "INSERT INTO gateway_api_keys (namespace, name, tenant, sha256, created_at_unix_ms) VALUES ('prod', 'x', 'x', 'ab', 1)",
            "DELETE FROM gateway_api_keys",
        ] {
            let refused = sqlx::query(write).execute(&gateway.pool).await;
            assert!(refused.is_err(), "{write}: {refused:?}");
        }
        assert_eq!(operator.list().await.unwrap().len(), 1);
        assert_eq!(operator.in_force().await.unwrap().len(), 1, "untouched");
        assert!(matches!(KeyTable::open_to_read("sqlite::memory:", "prod").await, Err(TableError::Invalid(_))));
    }

    #[test]
    fn passwords_stay_out_of_logs() {
        assert_eq!(redacted("postgres://turbine:s3cret@db:5432/keys"), "postgres://turbine:***@db:5432/keys");
        assert_eq!(redacted("postgres://db/keys?user=a"), "postgres://db/keys?user=a");
        assert_eq!(redacted("sqlite:/var/lib/keys.sqlite"), "sqlite:/var/lib/keys.sqlite");
    }
}
