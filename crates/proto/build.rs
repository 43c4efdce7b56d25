//! Compiles `proto/` without a system `protoc`: protox parses the files into
//! a descriptor set (source info kept, so comments reach rustdoc and gRPC
//! reflection), tonic-prost-build generates the code from it, and each
//! package's descriptor set is written to OUT_DIR for reflection.

use std::path::PathBuf;

/// (package, file relative to `proto/`)
const PACKAGES: &[(&str, &str)] = &[
    ("turbine.kvindex.v1", "turbine/kvindex/v1/kvindex.proto"),
    ("turbine.kvstore.v1", "turbine/kvstore/v1/kvstore.proto"),
    ("turbine.gateway.v1", "turbine/gateway/v1/gateway.proto"),
    ("turbine.planner.v1", "turbine/planner/v1/planner.proto"),
    ("turbine.router.v1", "turbine/router/v1/router.proto"),
    ("turbine.worker.v1", "turbine/worker/v1/worker.proto"),
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    println!("cargo:rerun-if-changed={}", proto_root.display());

    for (package, file) in PACKAGES {
        println!("cargo:rerun-if-changed={}", proto_root.join(file).display());
        let descriptor_set = protox::compile([file], [&proto_root])?;
        let encoded = prost::Message::encode_to_vec(&descriptor_set);
        std::fs::write(out_dir.join(format!("{package}.bin")), encoded)?;
        tonic_prost_build::configure().build_client(true).build_server(true).emit_rerun_if_changed(false).compile_fds(descriptor_set)?;
    }
    Ok(())
}
