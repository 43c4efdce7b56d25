//! Generated types and `tonic::Status` stop at the edges: read from the
//! sources, no public function outside the edges takes or returns a
//! generated message (`pb::...`, `turbine_proto::<package>::v1::...`) or a
//! `tonic::Status`, and no public type outside them holds a status.
//!
//! The edges: `crates/proto` (the contracts), `crates/runtime` (the
//! service host), each gRPC shell (`services/<name>/src/service.rs`), and
//! in `turbine-api` the clients and conversions (`<name>/client.rs`,
//! `wire.rs`) and the one status mapping (`error.rs`).

use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("the workspace")
}

fn sources(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a source folder").flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, found);
        } else if path.extension().is_some_and(|extension| extension == "rs") {
            found.push(path);
        }
    }
}

fn is_edge(relative: &str) -> bool {
    let parts: Vec<&str> = relative.split('/').collect();
    relative.starts_with("crates/proto/")
        || relative.starts_with("crates/runtime/")
        || matches!(parts.as_slice(), ["services", _, "src", "service.rs"])
        || matches!(parts.as_slice(), ["crates", "api", "src", "error.rs" | "wire.rs"])
        || matches!(parts.as_slice(), ["crates", "api", "src", _, "client.rs"])
}

/// The text from `start` to the first of `stops` (or the end).
fn until<'a>(text: &'a str, start: usize, stops: &[char]) -> &'a str {
    let end = text[start..].find(stops).map_or(text.len(), |at| start + at);
    &text[start..end]
}

/// The block opened by the first `{` after `start`, braces balanced.
fn block(text: &str, start: usize) -> &str {
    let Some(open) = text[start..].find('{').map(|at| start + at) else { return "" };
    let mut depth = 0;
    for (at, c) in text[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return &text[open..=open + at];
                }
            }
            _ => {}
        }
    }
    &text[open..]
}

/// What in `source` crosses the edge: (line, what).
fn crossings(source: &str) -> Vec<(usize, String)> {
    // Unit tests may speak the wire.
    let code = source.split("#[cfg(test)]").next().unwrap_or_default();
    let imports_status = code.lines().any(|line| line.starts_with("use tonic::") && line.contains("Status"));
    let names_status =
        |text: &str| text.contains("tonic::Status") || (imports_status && text.split(|c: char| !c.is_alphanumeric() && c != '_').any(|word| word == "Status"));
    let names_generated = |text: &str| text.contains("pb::") || (text.contains("turbine_proto::") && text.contains("::v1::"));
    let line_of = |at: usize| code[..at].matches('\n').count() + 1;
    let mut found = Vec::new();
    for (at, _) in code.match_indices("pub fn ").chain(code.match_indices("pub async fn ")) {
        let signature = until(code, at, &['{', ';']);
        if names_status(signature) || names_generated(signature) {
            found.push((line_of(at), signature.split_whitespace().collect::<Vec<_>>().join(" ")));
        }
    }
    for (at, _) in code.match_indices("pub enum ").chain(code.match_indices("pub struct ")) {
        let body = block(code, at);
        if names_status(body) {
            found.push((line_of(at), format!("{} holds a tonic::Status", until(code, at, &['{', '(', '<']).trim())));
        }
    }
    found
}

#[test]
fn no_generated_type_or_status_crosses_a_public_signature_outside_the_edges() {
    let root = workspace();
    let mut files = Vec::new();
    for group in ["crates", "services"] {
        for member in std::fs::read_dir(root.join(group)).expect("members").flatten() {
            let src = member.path().join("src");
            if src.is_dir() {
                sources(&src, &mut files);
            }
        }
    }
    assert!(files.len() > 100, "read {} source files", files.len());
    let mut crossing = Vec::new();
    for path in files {
        let relative = path.strip_prefix(&root).expect("inside the workspace").to_string_lossy().replace('\\', "/");
        if is_edge(&relative) {
            continue;
        }
        let source = std::fs::read_to_string(&path).expect("a source file");
        crossing.extend(crossings(&source).into_iter().map(|(line, what)| format!("{relative}:{line}: {what}")));
    }
    assert!(crossing.is_empty(), "generated types or tonic::Status outside the edges (convert at the edge instead):\n{}", crossing.join("\n"));
}

#[test]
fn the_scan_sees_what_it_forbids() {
    let source = "use tonic::{Request, Status};\n\
                  pub fn leaks(request: pb::GenerateRequest) -> u32 { 0 }\n\
                  pub async fn refuses() -> Result<(), Status> { Ok(()) }\n\
                  pub enum CallError { Rpc(tonic::Status) }\n\
                  pub fn fine(count: u32) -> u32 { count }\n\
                  #[cfg(test)]\nmod tests { pub fn free(_: pb::Block) {} }\n";
    let lines: Vec<usize> = crossings(source).into_iter().map(|(line, _)| line).collect();
    assert_eq!(lines, [2, 3, 4], "{:?}", crossings(source));
    assert!(is_edge("services/router/src/service.rs") && is_edge("crates/api/src/router/client.rs"));
    assert!(!is_edge("services/router/src/router/types.rs") && !is_edge("crates/api/src/router/mod.rs"));
}
