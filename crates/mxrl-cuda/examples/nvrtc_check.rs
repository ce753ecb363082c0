//! Host-side compile check of the engine's op kernels: NVRTC compiles each module exactly as
//! [`mxrl_cuda::gpu::Gpu::module`] does (prelude + common helpers + source, the engine's
//! options, `compute_90a` as on an H100 or H200), no GPU needed. Writes the PTX next to
//! `--out DIR` when given, so `ptxas -arch=sm_90a -v` can report registers, shared memory and
//! spills.
//!
//! `cargo run --release -p mxrl-cuda --features cuda --example nvrtc_check [-- --out DIR]`
//! (needs `libnvrtc` on the library path). `--sources DIR` instead writes each module's full
//! source (`DIR/NAME.cu`, what NVRTC would compile) and the generated prelude
//! (`DIR/prelude.cuh`), and compiles nothing (no NVRTC needed): the input of `scripts/cuemu.sh`.

#[cfg(feature = "cuda")]
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let out = args
        .iter()
        .position(|a| a == "--out")
        .map(|i| std::path::PathBuf::from(&args[i + 1]));
    let modules = mxrl_cuda::ops::SOURCES;
    if let Some(i) = args.iter().position(|a| a == "--sources") {
        let dir = std::path::PathBuf::from(args.get(i + 1).expect("--sources DIR"));
        std::fs::create_dir_all(&dir).expect("create --sources");
        for (name, src) in modules {
            let path = dir.join(format!("{name}.cu"));
            std::fs::write(&path, mxrl_cuda::gpu::op_module_source(src))
                .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        }
        // The quantizer module (`CudaDevice`), and the generated prelude alone, for assembling
        // another revision's module sources.
        std::fs::write(dir.join("quant.cu"), mxrl_cuda::module_source()).expect("write quant");
        std::fs::write(dir.join("prelude.cuh"), mxrl_cuda::cuda_prelude()).expect("write prelude");
        println!("{} module sources in {}", modules.len(), dir.display());
        return;
    }
    let mut failed = 0;
    for (name, src) in modules {
        match mxrl_cuda::gpu::compile_op_module(name, src, Some("compute_90a")) {
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
