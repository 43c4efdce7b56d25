//! Links the system's UCX (Debian: `libucx-dev`). The bindings in
//! `src/bindings.rs` were generated from its headers (see lib.rs), so no
//! libclang is needed to build.

fn main() {
    println!("cargo:rustc-link-lib=dylib=ucp");
    println!("cargo:rustc-link-lib=dylib=ucs");
}
