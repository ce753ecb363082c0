//! Weight updates received on the host, copied to the device through the page-locked staging
//! buffers (`Gpu::write_staged`), against the CPU backend (the reference):
//!
//! - `upload_bf16_bytes` of more than two staging buffers of bytes (odd tail included) gives
//!   back exactly those BF16 bit patterns (`download_bf16`), and widened on the device they are
//!   the CPU backend's f32 values bit for bit;
//! - `upload_stored` of every block format's wire bytes (MXFP8, NVFP4 with one amax per
//!   weight, FP8-block 128×128 tiles) keeps exactly the stored tensors the CPU backend keeps
//!   from the same bytes (`stored_weights` equal), and its device checksum is the reference's;
//! - a weight whose scale bytes are one short is refused naming it.
//!
//! And the way back: `download_f32_with` / `download_u32_with`, read back through the one
//! page-locked read-back buffer (`Gpu::download_with`) as it grows and is reused, give exactly
//! what `download_f32` / `download_u32` give, once per call, and refuse a short buffer.
//!
//! And a buffer larger than the device (an update of a model that does not fit) fails with an
//! error that says so, with its size and the device's free memory.
#![cfg(feature = "cuda")]

use mxrl_cuda::backend::CudaBackend;
use mxrl_cuda::gpu::STAGING_BYTES;
use mxrl_formats::{Format, Padding, QuantizedTensor, Scales};
use mxrl_tensor::device::{Backend, CpuBackend, StoredBytes};
use mxrl_tensor::gradcheck::test_values;
use mxrl_tensor::qlinear::{BackwardMode, LinearSpec};

fn gpu() -> CudaBackend {
    CudaBackend::new(0)
        .unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is not usable: {e}"))
}

#[test]
fn bf16_bytes_staged_to_the_device_are_the_same_bits() {
    let cb = gpu();
    // 2.5 staging buffers of values: every buffer refilled once, the last one partly.
    let n = STAGING_BYTES + STAGING_BYTES / 4 + 3;
    let bits: Vec<u16> = (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 9) as u16 & 0x7f7f)
        .collect();
    let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    let d = cb.upload_bf16_bytes(&bytes).unwrap();
    assert_eq!(cb.download_bf16(&d, n).unwrap(), bits);
    let mut wide = cb.empty_f32(n).unwrap();
    cb.widen_bf16(&d, &mut wide, n).unwrap();
    let want = CpuBackend.upload_bf16_bytes(&bytes).unwrap();
    let got = cb.download_f32(&wide, n).unwrap();
    assert!(
        got.iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "widened values differ from the CPU's"
    );
    assert!(cb.upload_bf16_bytes(&bytes[..3]).is_err());
}

fn wire<'a>(name: &'a str, q: &'a QuantizedTensor, scales: &'a [u8]) -> StoredBytes<'a> {
    StoredBytes {
        name,
        data: &q.data,
        scales,
        amax: &q.amax,
    }
}

#[test]
fn stored_bytes_staged_to_the_device_are_the_cpu_backends_stored_weights() {
    let cb = gpu();
    let cases = [
        (Format::Mxfp8, 3usize, 64usize, 96usize),
        (Format::Nvfp4, 3, 64, 96),
        (Format::Fp8Block, 2, 256, 384),
    ];
    for (ci, (f, groups, n, k)) in cases.into_iter().enumerate() {
        let spec = LinearSpec::new(f, BackwardMode::HighPrecision).unwrap();
        let scheme = spec.weight_scheme().unwrap();
        let tag = format!("{f} [{groups}·{n}, {k}]");
        let qs: Vec<QuantizedTensor> = (0..groups)
            .map(|g| {
                let seed = 70 + 10 * ci as u64 + g as u64;
                let w = test_values(n * k, seed, 1.0);
                mxrl_formats::quantize(&w, &[n, k], scheme, Padding::Reject).unwrap()
            })
            .collect();
        let scale_bytes: Vec<Vec<u8>> = qs
            .iter()
            .map(|q| match &q.scales {
                Scales::Bytes(b) => b.clone(),
                Scales::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            })
            .collect();
        let names: Vec<String> = (0..groups).map(|g| format!("w.{g}")).collect();
        let ws: Vec<StoredBytes<'_>> = (0..groups)
            .map(|g| wire(&names[g], &qs[g], &scale_bytes[g]))
            .collect();
        let qd = cb.upload_stored(spec, n, k, &ws).unwrap();
        let qc = CpuBackend.upload_stored(spec, n, k, &ws).unwrap();
        let stored = CpuBackend.stored_weights(&qc).unwrap();
        assert_eq!(stored, qs, "{tag}: the CPU keeps the bytes sent");
        assert_eq!(
            cb.stored_weights(&qd).unwrap(),
            stored,
            "{tag}: stored bytes"
        );
        let mut sums = cb.zeros_u32(2).unwrap();
        cb.checksum_qweights(&qd, &mut sums, 0).unwrap();
        let w = cb.download_u32(&sums, 2).unwrap();
        let want = mxrl_tensor::device::checksum_stored(&stored.iter().collect::<Vec<_>>());
        assert_eq!(u64::from(w[0]) | (u64::from(w[1]) << 32), want, "{tag}");
        // One weight's scales one byte short: refused by name, on both backends.
        let short = &scale_bytes[1][..scale_bytes[1].len() - 1];
        let mut bad = ws.clone();
        bad[1] = wire(&names[1], &qs[1], short);
        for e in [
            cb.upload_stored(spec, n, k, &bad).err().unwrap(),
            CpuBackend.upload_stored(spec, n, k, &bad).err().unwrap(),
        ] {
            assert!(e.to_string().contains("w.1"), "{tag}: {e}");
        }
    }
}

#[test]
fn read_backs_through_the_page_locked_buffer_are_the_downloads() {
    let cb = gpu();
    let big = 3 * STAGING_BYTES / 4 + 5;
    let fv = test_values(big, 7, 3.0);
    let uv: Vec<u32> = (0..big as u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let (fd, ud) = (cb.upload_f32(&fv).unwrap(), cb.upload_u32(&uv).unwrap());
    // Small first (the buffer is allocated), then the whole buffers (it grows), then smaller
    // again (it is kept: its first bytes are rewritten), f32 and u32 sharing it.
    for n in [1000, big, 17, big - 3, big] {
        let want = cb.download_f32(&fd, n).unwrap();
        let mut calls = 0;
        cb.download_f32_with(&fd, n, &mut |h| {
            calls += 1;
            assert_eq!(h.len(), n);
            assert!(
                h.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "f32 read-back of {n}"
            );
        })
        .unwrap();
        assert_eq!(calls, 1, "f32 read-back of {n}");
        let want = cb.download_u32(&ud, n).unwrap();
        let mut calls = 0;
        cb.download_u32_with(&ud, n, &mut |h| {
            calls += 1;
            assert_eq!(h, want.as_slice(), "u32 read-back of {n}");
        })
        .unwrap();
        assert_eq!(calls, 1, "u32 read-back of {n}");
    }
    // Nothing asked for: `f` sees no elements.
    let mut seen = usize::MAX;
    cb.download_f32_with(&fd, 0, &mut |h| seen = h.len())
        .unwrap();
    assert_eq!(seen, 0);
    // What the device wrote after a read-back is what the next one sees.
    let mut wide = cb.zeros_f32(big).unwrap();
    cb.add(&mut wide, &fd, big).unwrap();
    cb.add(&mut wide, &fd, big).unwrap();
    cb.download_f32_with(&wide, big, &mut |h| {
        assert!(h
            .iter()
            .zip(&fv)
            .all(|(a, b)| a.to_bits() == (2.0 * b).to_bits()));
    })
    .unwrap();
    // A buffer shorter than asked for: refused, `f` not called.
    let mut called = false;
    assert!(cb
        .download_f32_with(&fd, big + 1, &mut |_| called = true)
        .is_err());
    assert!(cb
        .download_u32_with(&ud, big + 1, &mut |_| called = true)
        .is_err());
    assert!(!called);
}

#[test]
fn an_allocation_past_the_device_memory_says_how_large_and_how_much_is_free() {
    let b = gpu();
    // 2⁴³ f32 values: 32 TiB, past any device.
    let e = match b.zeros_f32(1 << 43) {
        Ok(_) => panic!("a 32 TiB buffer was allocated"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("out of device memory allocating 8796093022208 elements, 32768.000 GiB"),
        "{e}"
    );
    assert!(e.contains("GiB free)"), "{e}");
}
