//! Compiles `proto/rollout.proto` (the rollout service) into Rust with protox, a pure-Rust
//! protobuf compiler: no system `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/rollout.proto");
    let fds = protox::compile(["rollout.proto"], ["proto"])?;
    tonic_prost_build::configure()
        // Bucket payloads are reference-counted buffers: a received payload is the slice of
        // the decode buffer it arrived in, and a sender hands its encoded buckets over
        // without copying them again.
        .bytes(".mxrl.rollout.v1.WeightBucket.payload")
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
