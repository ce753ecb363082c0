//! Host-side compile check of the engine's op kernels: NVRTC compiles each module exactly as
//! [`mxrl_cuda::gpu::Gpu::module`] does (prelude + common helpers + source, the engine's
//! options, `compute_90`), no GPU needed. Writes the PTX next to `--out DIR` when given, so
//! `ptxas -arch=sm_90 -v` can report registers, shared memory and spills.
//!
//! `cargo run --release -p mxrl-cuda --features cuda --example nvrtc_check [-- --out DIR]`
//! (needs `libnvrtc` on the library path).

#[cfg(feature = "cuda")]
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let out = args
        .iter()
        .position(|a| a == "--out")
        .map(|i| std::path::PathBuf::from(&args[i + 1]));
    let mut failed = 0;
    let modules = mxrl_cuda::ops::SOURCES;
    for (name, src) in modules {
        match mxrl_cuda::gpu::compile_op_module(name, src, Some("compute_90")) {
            Ok(ptx) => {
                println!("ok   {name}");
                if let Some(dir) = &out {
                    std::fs::create_dir_all(dir).expect("create --out");
                    std::fs::write(dir.join(format!("{name}.ptx")), ptx.to_src())
                        .expect("write ptx");
                }
            }
            Err(e) => {
                failed += 1;
                println!("FAIL {name}: {e}");
            }
        }
    }
    println!("{} passed, {failed} failed", modules.len() - failed);
    if failed > 0 {
        std::process::exit(1);
    }
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("nvrtc_check needs --features cuda");
    std::process::exit(2);
}
