//! The decode GEMM kernels (`kernels/ops_qgemm.cu`: fragment split and staged layouts, MXFP8 /
//! NVFP4 / BF16 / FP8 block, every pass size) run on the host under cuemu
//! (`scripts/cuemu/`: one fiber per CUDA thread, the kernels' inline PTX modelled, `cp.async`
//! groups deferred until their wait, barriers and warp collectives that fail on deadlock) and
//! checked against a host reference and against each other where they claim the same sums.
//! No GPU needed, so this runs everywhere the CPU tests do (it needs g++, nm and python3); it
//! checks indexing, staging and barriers, not speed and not the tensor cores' summation order.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn qgemm_kernels_match_the_host_reference_under_cuemu() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuemu");
    std::fs::create_dir_all(&tmp).expect("create the cuemu directory");
    let src = tmp.join("ops_qgemm.cu");
    std::fs::write(
        &src,
        mxrl_cuda::op_module_source(mxrl_cuda::ops::QGEMM_SOURCE),
    )
    .expect("write the module source");
    let out = Command::new("bash")
        .arg(root.join("scripts/cuemu/check.sh"))
        .arg(tmp.join("build"))
        .arg(&src)
        .output()
        .expect("run scripts/cuemu/check.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(
        out.status.success(),
        "cuemu's kernel checks failed ({}): the FAIL lines above name the kernel, pass size \
         and first differing output",
        out.status
    );
    // The checks ran: every configuration reports a line, and none failed.
    let passed = stdout.lines().filter(|l| l.starts_with("ok")).count();
    assert!(passed >= 50, "only {passed} checks reported passing");
    assert!(!stdout.contains("FAIL"), "a check failed");
}
