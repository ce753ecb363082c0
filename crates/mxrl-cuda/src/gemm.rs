//! [`CudaGemm`]: the linear layers' GEMMs ([`mxrl_tensor::backend::GemmBackend`]) on a GPU by
//! cuBLAS SGEMM in pedantic math, with resident weight operands cached on the device.
//!
//! # Numerics
//! The operands are the f32 values the CPU emulation multiplies — BF16-rounded values, exact
//! contract dequantizations (MXFP8), `e2m1·sf` (NVFP4, α applied by the caller after the sum,
//! as on the CPU) — uploaded bit for bit. cuBLAS multiplies them with f32 products and f32
//! accumulation (`CUBLAS_PEDANTIC_MATH`: no TF32, no reduced-precision inputs), so the only
//! difference from the CPU backend is the summation order (and FMA contraction, which only
//! removes roundings): each output is within `γ_k·Σ|a||b|` of the exact sum on both.
//!
//! # Determinism
//! One cuBLAS handle on one stream, default atomics mode (no atomics-based reductions), calls
//! serialized: the same call with the same shapes and operand values gives the same bits on
//! the same GPU and library, which is what bitwise mode relies on (tested on the device).
//!
//! # Residency
//! A weight view with a key ([`mxrl_tensor::backend::OperandKey`]) is uploaded on first use
//! and kept under that key until the operand is dropped ([`GemmBackend::release`]); the
//! values under a key never change, so a cached copy is never stale. Unkeyed operands
//! (activations, gradients, f32 master weights) are uploaded per call.

use crate::cuda::CudaDevice;
use crate::{DeviceError, QuantDevice};
use cudarc::driver::CudaSlice;
use mxrl_tensor::backend::{GemmBackend, GemmError, OperandKey, WeightView};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Upload / cache counters of a [`CudaGemm`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GemmStats {
    /// GEMM calls.
    pub calls: u64,
    /// Resident operands uploaded (cache misses).
    pub weight_uploads: u64,
    /// Calls that found their resident operand on the device.
    pub weight_hits: u64,
    /// Resident operands on the device now.
    pub resident: u64,
    /// Bytes of resident operands on the device now.
    pub resident_bytes: u64,
}

/// The GEMM backend on one GPU (see the module doc).
pub struct CudaGemm {
    dev: Arc<CudaDevice>,
    cache: Mutex<HashMap<OperandKey, CudaSlice<f32>>>,
    calls: AtomicU64,
    uploads: AtomicU64,
    hits: AtomicU64,
}

impl CudaGemm {
    /// The backend on GPU `ordinal` (shared device: one context, stream and cuBLAS handle).
    ///
    /// # Errors
    /// No driver, no such GPU, or a kernel-module compile error (as [`CudaDevice::new`]).
    pub fn new(ordinal: usize) -> Result<Self, DeviceError> {
        Ok(CudaGemm::on(CudaDevice::shared(ordinal)?))
    }

    /// The backend on an open device.
    pub fn on(dev: Arc<CudaDevice>) -> Self {
        CudaGemm {
            dev,
            cache: Mutex::new(HashMap::new()),
            calls: AtomicU64::new(0),
            uploads: AtomicU64::new(0),
            hits: AtomicU64::new(0),
        }
    }

    /// The device.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// Counters so far.
    pub fn stats(&self) -> GemmStats {
        let cache = self.cache.lock().expect("operand cache poisoned");
        GemmStats {
            calls: self.calls.load(Ordering::Relaxed),
            weight_uploads: self.uploads.load(Ordering::Relaxed),
            weight_hits: self.hits.load(Ordering::Relaxed),
            resident: cache.len() as u64,
            resident_bytes: cache.values().map(|s| 4 * s.len() as u64).sum(),
        }
    }

    fn err(&self, call: &str, e: DeviceError) -> GemmError {
        GemmError {
            backend: self.name(),
            what: format!("{call}: {e}"),
        }
    }

    /// Run `f` with the device copy of `w` (cached when keyed, uploaded otherwise).
    fn with_weight<T>(
        &self,
        call: &str,
        w: WeightView<'_>,
        f: impl FnOnce(&CudaSlice<f32>) -> Result<T, DeviceError>,
    ) -> Result<T, GemmError> {
        let up = |v: &[f32]| self.dev.upload_f32(v).map_err(|e| self.err(call, e));
        match w.key {
            None => {
                let d = up(w.values)?;
                f(&d).map_err(|e| self.err(call, e))
            }
            Some(key) => {
                let mut cache = self.cache.lock().expect("operand cache poisoned");
                if let Some(d) = cache.get(&key) {
                    if d.len() != w.values.len() {
                        // A key names one buffer of fixed values; a different length is a
                        // caller bug, never a stale-cache situation to paper over.
                        panic!(
                            "resident operand {key:?}: {} elements cached, {} passed",
                            d.len(),
                            w.values.len()
                        );
                    }
                    self.hits.fetch_add(1, Ordering::Relaxed);
                } else {
                    cache.insert(key, up(w.values)?);
                    self.uploads.fetch_add(1, Ordering::Relaxed);
                }
                f(&cache[&key]).map_err(|e| self.err(call, e))
            }
        }
    }

    fn download(&self, call: &str, d: &CudaSlice<f32>) -> Result<Vec<f32>, GemmError> {
        self.dev.download_f32(d).map_err(|e| self.err(call, e))
    }
}

impl GemmBackend for CudaGemm {
    fn name(&self) -> String {
        format!("{} (cuBLAS SGEMM, pedantic f32)", self.dev.name())
    }

    fn nt(
        &self,
        a: &[f32],
        w: WeightView<'_>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Vec<f32>, GemmError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if m == 0 || n == 0 || k == 0 {
            return Ok(vec![0.0; m * n]);
        }
        let da = self.dev.upload_f32(a).map_err(|e| self.err("nt", e))?;
        let y = self.with_weight("nt", w, |dw| self.dev.sgemm_nt(&da, dw, m, k, n))?;
        self.download("nt", &y)
    }

    fn nn(
        &self,
        a: &[f32],
        w: WeightView<'_>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Vec<f32>, GemmError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if m == 0 || n == 0 || k == 0 {
            return Ok(vec![0.0; m * n]);
        }
        let da = self.dev.upload_f32(a).map_err(|e| self.err("nn", e))?;
        let y = self.with_weight("nn", w, |dw| self.dev.sgemm_nn(&da, dw, m, k, n))?;
        self.download("nn", &y)
    }

    fn tn_into(
        &self,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        m: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<(), GemmError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            if !accumulate {
                c.fill(0.0);
            }
            return Ok(());
        }
        let e = |x| self.err("tn", x);
        let da = self.dev.upload_f32(a).map_err(e)?;
        let db = self.dev.upload_f32(b).map_err(|x| self.err("tn", x))?;
        let p = self
            .dev
            .sgemm_tn(&da, &db, m, k, n)
            .map_err(|x| self.err("tn", x))?;
        let p = self.download("tn", &p)?;
        // Accumulation on the host: c = fl(c + p), one rounding per element (the CPU
        // backend's β = 1 update is the same single addition).
        if accumulate {
            for (ci, pi) in c.iter_mut().zip(&p) {
                *ci += pi;
            }
        } else {
            c.copy_from_slice(&p);
        }
        Ok(())
    }

    fn release(&self, key: OperandKey) {
        // Dropping the slice frees it on the device's stream.
        if let Ok(mut cache) = self.cache.lock() {
            cache.remove(&key);
        }
    }
}
