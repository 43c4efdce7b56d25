//! `turbine keys`: API keys for the gateway's `--api-keys` file.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use turbine_gateway::ApiKeys;
use turbine_gateway::keys::{entry, new_key};

/// API keys.
#[derive(Debug, clap::Subcommand)]
pub enum KeysCommand {
    /// Make a key: print it (once: only its SHA-256 digest is kept) and add
    /// its entry to the keys file the gateway's --api-keys reads.
    New(NewKeyArgs),
}

/// `turbine keys new`.
#[derive(Debug, clap::Args)]
pub struct NewKeyArgs {
    /// The keys file (TOML; made, readable by its owner only, if absent).
    #[arg(long)]
    pub file: PathBuf,
    /// The key's name, in logs and metrics (unique in the file).
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
}

/// Runs a keys command.
pub fn run(command: &KeysCommand) -> anyhow::Result<()> {
    match command {
        KeysCommand::New(args) => new(args),
    }
}

fn new(args: &NewKeyArgs) -> anyhow::Result<()> {
    let key = new_key();
    let existing = match std::fs::read_to_string(&args.file) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(error) => return Err(error).with_context(|| format!("cannot read {}", args.file.display())),
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
    // The file as the gateway will read it, checked before it is written.
    ApiKeys::parse(&text).map_err(|error| anyhow::anyhow!("{}: {error}", args.file.display()))?;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(&args.file).with_context(|| format!("cannot write {}", args.file.display()))?;
    file.write_all(text.as_bytes()).with_context(|| format!("cannot write {}", args.file.display()))?;
    eprintln!("turbine: added key {:?} (tenant {:?}) to {}; the key, shown once:", args.name, args.tenant, args.file.display());
    println!("{key}");
    Ok(())
}
