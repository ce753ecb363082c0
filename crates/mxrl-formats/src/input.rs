//! High-precision inputs: f32, bf16 and f16, widened to f32 exactly.

use half::{bf16, f16};

/// An element type the quantizers accept. Widening to f32 is exact for all three.
pub trait HighPrecision: Copy + Send + Sync + 'static + private::Sealed {
    /// The safetensors dtype name (`F32`, `BF16`, `F16`).
    const DTYPE: &'static str;
    /// Exact widening to f32.
    fn to_f32(self) -> f32;
}

mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

impl HighPrecision for f32 {
    const DTYPE: &'static str = "F32";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl HighPrecision for bf16 {
    const DTYPE: &'static str = "BF16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

impl HighPrecision for f16 {
    const DTYPE: &'static str = "F16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self.to_f32()
    }
}

/// A borrowed high-precision tensor: row-major `data` of shape `[M, K]` or `[E, M, K]`.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a, T> {
    /// Row-major elements.
    pub data: &'a [T],
    /// `[M, K]` or `[E, M, K]`.
    pub shape: &'a [usize],
}

impl<'a, T> TensorRef<'a, T> {
    /// Borrow `data` with `shape`.
    pub fn new(data: &'a [T], shape: &'a [usize]) -> Self {
        TensorRef { data, shape }
    }
}
