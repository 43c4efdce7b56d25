//! `turbine keys`: API keys for the gateway's `--api-keys` file or its
//! `--api-keys-database`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use turbine_gateway::ApiKeys;
use turbine_gateway::keys::{KeyEntry, KeyTable, entry, expiry_of, new_key, now_unix_ms};

/// API keys.
#[derive(Debug, clap::Subcommand)]
pub enum KeysCommand {
    /// Make a key: print it (once: only its SHA-256 digest is kept) and add
    /// its entry to the keys file the gateway's --api-keys reads, or to the
    /// database its --api-keys-database reads.
    New(NewKeyArgs),
    /// Revoke a key in the database: every gateway of the namespace
    /// refuses it once it reads the keys again (--api-keys-reload-secs).
    /// Its row stays, and its name stays taken. (In a file: delete its
    /// entry.)
    Revoke(RevokeKeyArgs),
    /// List the keys in the database (names, tenants, limits, when made,
    /// when they expire and when revoked; never a key). Makes or migrates
    /// the table, as every keys command on a database does.
    List(DatabaseArgs),
}

/// The database the gateways read keys from.
#[derive(Debug, clap::Args)]
pub struct DatabaseArgs {
    /// The gateway's --api-keys-database: postgres://… or sqlite:FILE (its
    /// table is made if missing).
    #[arg(long, env = "TURBINE_GATEWAY_API_KEYS_DATABASE", value_name = "URL")]
    pub database: String,
    /// The deployment whose keys these are (the gateways' --namespace).
    #[arg(long, env = "TURBINE_NAMESPACE", default_value = "default")]
    pub namespace: String,
}

/// `turbine keys new`.
#[derive(Debug, clap::Args)]
pub struct NewKeyArgs {
    /// The keys file (TOML; made, readable by its owner only, if absent).
    #[arg(long, required_unless_present = "database", conflicts_with = "database")]
    pub file: Option<PathBuf>,
    /// The database instead of a file: postgres://… or sqlite:FILE.
    #[arg(long, value_name = "URL")]
    pub database: Option<String>,
    /// With --database, the deployment whose key it is (the gateways'
    /// --namespace).
    #[arg(long, env = "TURBINE_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// The key's name, in logs and metrics (unique in the file, or in the
    /// namespace, revoked keys included).
    #[arg(long)]
    pub name: String,
    /// The tenant whose prompt cache the key's requests use.
    #[arg(long)]
    pub tenant: String,
    /// Opt in to a prompt cache shared by every key naming it (e.g. for a
    /// common system prompt), instead of the tenant's own.
    #[arg(long)]
    pub share_prefixes: Option<String>,
    /// Requests a minute the key may make (429 with Retry-After beyond).
    #[arg(long)]
    pub requests_per_minute: Option<u32>,
    /// Tokens (prompt and completion) a minute the key may use.
    #[arg(long)]
    pub tokens_per_minute: Option<u64>,
    /// Requests the key may have in flight at once.
    #[arg(long)]
    pub max_concurrent: Option<u32>,
    /// When the key stops authenticating: an RFC 3339 date-time with its
    /// offset (2027-01-01T00:00:00Z). Its holder is told it expired (401)
    /// from then on; its entry or row stays. Unset: it never expires.
    #[arg(long, value_name = "DATETIME", value_parser = future_expiry)]
    pub expires_at: Option<(i64, String)>,
}

/// `--expires-at`: Unix milliseconds, and the text as given; never past.
fn future_expiry(text: &str) -> Result<(i64, String), String> {
    let at = expiry_of(text)?;
    if at <= now_unix_ms() {
        return Err(format!("{text} is past: a key made now would never authenticate"));
    }
    Ok((at, text.trim().to_owned()))
}

/// `turbine keys revoke`.
#[derive(Debug, clap::Args)]
pub struct RevokeKeyArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// The key's name.
    #[arg(long)]
    pub name: String,
}

/// Runs a keys command.
pub fn run(command: &KeysCommand) -> anyhow::Result<()> {
    match command {
        KeysCommand::New(args) => match (&args.file, &args.database) {
            (Some(file), _) => new(args, file),
            (None, Some(url)) => on_database(async { new_in_database(args, &KeyTable::open(url, &args.namespace).await?).await }),
            (None, None) => anyhow::bail!("give --file or --database"),
        },
        KeysCommand::Revoke(args) => on_database(async {
            let table = KeyTable::open(&args.database.database, &args.database.namespace).await?;
            table.revoke(&args.name).await?;
            eprintln!(
                "turbine: revoked key {:?} in namespace {:?} of {}; gateways refuse it once they read the keys again",
                args.name,
                table.namespace(),
                table.url()
            );
            Ok(())
        }),
        KeysCommand::List(args) => on_database(async {
            let table = KeyTable::open(&args.database, &args.namespace).await?;
            list(&table).await
        }),
    }
}

/// Runs `work` on a runtime of its own (the database client is async).
fn on_database(work: impl std::future::Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_current_thread().enable_all().build().context("cannot start a runtime")?.block_on(work)
}

async fn new_in_database(args: &NewKeyArgs, table: &KeyTable) -> anyhow::Result<()> {
    let key = new_key();
    let entry = KeyEntry {
        name: args.name.clone(),
        tenant: args.tenant.clone(),
        share_prefixes: args.share_prefixes.clone(),
        requests_per_minute: args.requests_per_minute,
        tokens_per_minute: args.tokens_per_minute,
        max_concurrent: args.max_concurrent,
        expires_at_unix_ms: args.expires_at.as_ref().map(|(at, _)| *at),
    };
    table.add(&entry, &key).await?;
    eprintln!("turbine: added key {:?} (tenant {:?}) to namespace {:?} of {}; the key, shown once:", args.name, args.tenant, table.namespace(), table.url());
    println!("{key}");
    Ok(())
}

async fn list(table: &KeyTable) -> anyhow::Result<()> {
    let keys = table.list().await?;
    let limit = |value: Option<u64>| value.map_or("-".to_owned(), |value| value.to_string());
    let when = turbine_planner::audit::utc;
    println!("{:<24} {:<16} {:<12} {:>8} {:>10} {:>6} {:<20} {:<20} REVOKED", "NAME", "TENANT", "SHARES", "RPM", "TPM", "AT ONCE", "CREATED", "EXPIRES");
    for key in &keys {
        let entry = &key.entry;
        println!(
            "{:<24} {:<16} {:<12} {:>8} {:>10} {:>6} {:<20} {:<20} {}",
            entry.name,
            entry.tenant,
            entry.share_prefixes.as_deref().unwrap_or("-"),
            limit(entry.requests_per_minute.map(u64::from)),
            limit(entry.tokens_per_minute),
            limit(entry.max_concurrent.map(u64::from)),
            when(key.created_at_unix_ms),
            entry.expires_at_unix_ms.map_or("-".to_owned(), when),
            key.revoked_at_unix_ms.map_or("-".to_owned(), when),
        );
    }
    eprintln!(
        "turbine: {} keys in namespace {:?} of {}, {} in force",
        keys.len(),
        table.namespace(),
        table.url(),
        keys.iter().filter(|key| key.revoked_at_unix_ms.is_none()).count()
    );
    Ok(())
}

fn new(args: &NewKeyArgs, path: &std::path::Path) -> anyhow::Result<()> {
    let key = new_key();
    let existing = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(error) => return Err(error).with_context(|| format!("cannot read {}", path.display())),
    };
    let mut text = existing.clone();
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    if !text.is_empty() {
        text.push('\n');
    }
    text.push_str(&entry(&args.name, &args.tenant, args.share_prefixes.as_deref(), &key));
    for (field, value) in [
        ("requests_per_minute", args.requests_per_minute.map(u64::from)),
        ("tokens_per_minute", args.tokens_per_minute),
        ("max_concurrent", args.max_concurrent.map(u64::from)),
    ] {
        if let Some(value) = value {
            text.push_str(&format!("{field} = {value}\n"));
        }
    }
    if let Some((_, at)) = &args.expires_at {
        text.push_str(&format!("expires_at = {at}\n"));
    }
    // The file as the gateway will read it, checked before it is written.
    ApiKeys::parse(&text).map_err(|error| anyhow::anyhow!("{}: {error}", path.display()))?;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(path).with_context(|| format!("cannot write {}", path.display()))?;
    file.write_all(text.as_bytes()).with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!("turbine: added key {:?} (tenant {:?}) to {}; the key, shown once:", args.name, args.tenant, path.display());
    println!("{key}");
    Ok(())
}
