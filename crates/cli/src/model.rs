//! `turbine model`: the model cache.

use turbine_tokens::pull::{CATALOG, Progress, cached_path, catalog_entry, default_cache_dir, pull};

/// `turbine model` subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum ModelCommand {
    /// Fetch a catalog model into the cache and verify it (does nothing if
    /// a verified copy is there).
    Pull {
        /// Model name (see `turbine model list`).
        name: String,
    },
    /// List the catalog and what is cached.
    List,
}

/// Runs a `turbine model` subcommand.
pub fn run(command: ModelCommand) -> anyhow::Result<()> {
    let cache_dir = default_cache_dir();
    match command {
        ModelCommand::Pull { name } => {
            let entry = catalog_entry(&name).ok_or_else(|| {
                let known: Vec<&str> = CATALOG.iter().map(|entry| entry.name).collect();
                anyhow::anyhow!("unknown model {name:?}; known models: {}", known.join(", "))
            })?;
            let path = pull(entry, &cache_dir, Progress::Bars)?;
            println!("{} ready at {}", entry.name, path.display());
        }
        ModelCommand::List => {
            for entry in CATALOG {
                let path = cached_path(entry, &cache_dir);
                let state = if path.is_file() { format!("cached at {}", path.display()) } else { "not cached".to_owned() };
                println!("{:<16} {} ({state})", entry.name, entry.description);
            }
        }
    }
    Ok(())
}
