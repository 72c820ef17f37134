//! Builds the C shim over libfabric when the `rdma` feature is on (most of
//! libfabric's API is `static inline` in its headers, which Rust cannot
//! call); the default build compiles no C.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "rdma")]
    {
        println!("cargo:rerun-if-changed=src/rdma/shim.c");
        cc::Build::new()
            .file("src/rdma/shim.c")
            .warnings(true)
            .extra_warnings(true)
            .compile("abtl_ofi");
        println!("cargo:rustc-link-lib=fabric");
    }
}
