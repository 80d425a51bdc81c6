//! With the `remote` feature: generates the gRPC client types from the project's own
//! `proto/inference.proto` with protox (a protobuf compiler in Rust: no protoc needed) and
//! tonic-prost-build.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let file = proto_dir.join("inference.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    if std::env::var_os("CARGO_FEATURE_REMOTE").is_none() {
        return Ok(());
    }
    let fds = protox::compile([&file], [&proto_dir])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .build_transport(false)
        .bytes(".inference.ModelInferRequest.raw_input_contents")
        .bytes(".inference.ModelInferResponse.raw_output_contents")
        .compile_fds(fds)?;
    Ok(())
}
