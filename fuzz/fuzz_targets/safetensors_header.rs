//! Fuzz the safetensors header parser: it must never panic, and an accepted header must
//! describe tensors that lie back to back inside the data section.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = mxrl_ckpt::parse_header("fuzz", data) {
        let len = data.len() - h.data_start;
        let mut end = 0;
        for t in &h.tensors {
            assert!(t.begin <= t.end && t.end <= len);
            assert_eq!(t.end - t.begin, t.numel() * t.dtype.size());
            if t.end > t.begin {
                assert_eq!(t.begin, end);
                end = t.end;
            }
        }
        assert_eq!(end, len);
    }
});
