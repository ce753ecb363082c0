//! The header and index parsers over the committed corpus of malformed inputs (also the seed
//! corpus of the cargo-fuzz targets in `fuzz/`), plus a seeded mutation sweep: every input is
//! rejected with the expected message, nothing panics, and whatever is accepted is consistent.

use mxrl_ckpt::{header_bytes, parse_header, parse_index, Dtype, TensorSpec};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::path::PathBuf;

fn corpus(dir: &str) -> (PathBuf, BTreeMap<String, String>) {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/corpus")
        .join(dir);
    let exp = std::fs::read(d.join("expected.json"))
        .unwrap_or_else(|e| panic!("{}: {e} (regenerate with make_corpus.py)", d.display()));
    (d, serde_json::from_slice(&exp).unwrap())
}

#[test]
fn every_malformed_header_is_rejected_with_its_message() {
    let (d, exp) = corpus("headers");
    assert!(exp.len() >= 20, "corpus has {} cases", exp.len());
    for (name, want) in &exp {
        let bytes = std::fs::read(d.join(name)).unwrap();
        let err = parse_header(name, &bytes).expect_err(name).to_string();
        assert!(err.contains(want), "{name}: `{err}` lacks `{want}`");
        assert!(err.contains(name), "{name}: `{err}` does not name the file");
    }
}

#[test]
fn every_malformed_index_is_rejected_with_its_message() {
    let (d, exp) = corpus("index");
    assert!(exp.len() >= 10);
    for (name, want) in &exp {
        let bytes = std::fs::read(d.join(name)).unwrap();
        let err = parse_index(name, &bytes).expect_err(name).to_string();
        assert!(err.contains(want), "{name}: `{err}` lacks `{want}`");
        assert!(err.contains(name), "{name}: `{err}` does not name the file");
    }
}

fn valid_file() -> Vec<u8> {
    let specs = vec![
        TensorSpec::new("a", Dtype::Bf16, vec![3, 4]),
        TensorSpec::new("b", Dtype::F32, vec![2]),
        TensorSpec::new("c", Dtype::U8, vec![0]),
        TensorSpec::new("d", Dtype::F8E4m3, vec![5]),
    ];
    let mut f = header_bytes(&specs, &[("format".into(), "pt".into())].into());
    let n: usize = specs.iter().map(|s| s.nbytes()).sum();
    f.extend((0..n).map(|i| i as u8));
    f
}

#[test]
fn valid_file_parses() {
    let f = valid_file();
    let h = parse_header("v", &f).unwrap();
    let names: Vec<_> = h.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "b", "c", "d"]); // by offset; the empty `c` sits at 32, before `d`
    assert_eq!(h.metadata["format"], "pt");
    assert_eq!(h.data_start % 8, 0);
}

/// 3000 seeded mutations (byte flips, truncations, length-prefix edits, JSON edits) of a valid
/// file: the parser never panics and every accepted header is internally consistent.
#[test]
fn mutated_headers_never_panic_and_accepted_ones_are_consistent() {
    let base = valid_file();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut accepted = 0;
    for case in 0..3000 {
        let mut f = base.clone();
        match rng.gen_range(0..5) {
            0 => {
                let i = rng.gen_range(0..f.len());
                f[i] ^= 1 << rng.gen_range(0..8);
            }
            1 => f.truncate(rng.gen_range(0..f.len())),
            2 => {
                let n = u64::from_le_bytes(f[..8].try_into().unwrap());
                let d: i64 = rng.gen_range(-16..16);
                f[..8].copy_from_slice(&(n as i64 + d).max(0).to_le_bytes());
            }
            3 => {
                // Replace one digit of the JSON header by another digit.
                let n = u64::from_le_bytes(f[..8].try_into().unwrap()) as usize;
                let digits: Vec<usize> = (8..8 + n).filter(|&i| f[i].is_ascii_digit()).collect();
                let i = digits[rng.gen_range(0..digits.len())];
                f[i] = b'0' + rng.gen_range(0..10);
            }
            _ => f.extend(std::iter::repeat_n(0u8, rng.gen_range(1..9))),
        }
        if let Ok(h) = parse_header("m", &f) {
            accepted += 1;
            let data = f.len() - h.data_start;
            let mut end = 0;
            for t in &h.tensors {
                assert!(t.end <= data, "case {case}: {t:?} past {data}");
                assert_eq!(t.nbytes(), t.numel() * t.dtype.size(), "case {case}");
                if t.nbytes() > 0 {
                    assert_eq!(t.begin, end, "case {case}: gap or overlap");
                    end = t.end;
                }
            }
            assert_eq!(end, data, "case {case}");
        }
    }
    // Some mutations (e.g. flipping a data byte) keep the file valid; most do not.
    assert!(accepted > 0 && accepted < 3000, "accepted {accepted}");
}
