//! Live weight sync: trainer → rollout, quantized once, bucketed, versioned, verified.
//!
//! An update is a [`UpdateHeader`] (version, contract hash, bucket count, tensor count, total
//! bytes) plus buckets; each bucket carries a SHA-256 of its payload (the protobuf encoding of
//! a `TensorList` of `proto/rollout.proto`, a tensor never split). The receiver
//! ([`UpdateAssembler`]) checks the contract hash first (a mismatch is refused), then every
//! bucket's index, size and checksum, then completeness; only then does the rollout engine swap
//! its weights ([`RolloutEngine::apply`]), and the policy's `load_weights` validates every
//! tensor before it changes anything. A failed or partial update leaves the rollout serving the
//! previous version and is reported as an error.
//!
//! In one process the buckets are handed over as they are; across processes they travel as the
//! messages of the rollout service's `UpdateWeights` call ([`crate::server`]).

use crate::policy::{PolicyError, RolloutPolicy, WireTensor};
use crate::proto as pb;
use bytes::Bytes;
use mxrl_formats::Format;
use prost::Message;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Errors of weight sync.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// The update was made under another quantizer contract.
    #[error("weight update v{version}: contract hash {got} differs from the rollout's {expected}; refusing it")]
    ContractMismatch {
        /// Update version.
        version: u64,
        /// Hash in the update.
        got: String,
        /// Hash the rollout was built with.
        expected: String,
    },
    /// A bucket failed verification.
    #[error("weight update v{version}: bucket {index}: {msg}")]
    Bucket {
        /// Update version.
        version: u64,
        /// Bucket index.
        index: u32,
        /// What failed.
        msg: String,
    },
    /// Buckets are missing at commit time.
    #[error("weight update v{version}: incomplete, {missing} of {total} buckets missing")]
    Incomplete {
        /// Update version.
        version: u64,
        /// Missing buckets.
        missing: usize,
        /// Expected buckets.
        total: usize,
    },
    /// Version does not advance.
    #[error("weight update v{got}: not newer than the served version v{current}")]
    Stale {
        /// Version in the update.
        got: u64,
        /// Version served now.
        current: u64,
    },
    /// The policy refused the tensors.
    #[error("weight update v{version}: {}", policy_reason(error))]
    Policy {
        /// Update version.
        version: u64,
        /// The policy's error (in the message, not a separate cause, so it is said once).
        error: PolicyError,
    },
    /// The header announces more than the receiver accepts (checked before anything is
    /// allocated).
    #[error("weight update v{version}: {what} {got} exceeds the limit {limit}")]
    Limit {
        /// Update version.
        version: u64,
        /// What was counted (`tensors`, `bytes`, `buckets`).
        what: &'static str,
        /// The announced value.
        got: u64,
        /// The limit.
        limit: u64,
    },
    /// Transport failure (connection dropped mid-update, bad message).
    #[error("weight sync transport: {0}")]
    Transport(String),
    /// The receiver rejected the update.
    #[error("weight update rejected by the rollout: {0}")]
    Rejected(String),
    /// `--check-weight-sync` found different bytes.
    #[error("weight sync check: tensor {name}: {msg}")]
    CheckFailed {
        /// Tensor.
        name: String,
        /// What differs.
        msg: String,
    },
}

/// A policy's refusal as [`SyncError::Policy`] words it: an update's own error without its
/// "weight update: " (the version's prefix says it), any other error as it is.
fn policy_reason(e: &PolicyError) -> String {
    match e {
        PolicyError::Update(m) => m.clone(),
        e => e.to_string(),
    }
}

/// The header of an update.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateHeader {
    /// Weight version (the trainer's optimizer step count).
    pub version: u64,
    /// Quantizer contract hash of the sender.
    pub contract_hash: String,
    /// Buckets that follow.
    pub buckets: u32,
    /// Tensors in all buckets.
    pub tensors: u32,
    /// Payload bytes in all buckets.
    pub bytes: u64,
}

/// One bucket: serialized tensors plus their SHA-256.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Position in the update.
    pub index: u32,
    /// SHA-256 of `payload`.
    pub checksum: [u8; 32],
    /// Serialized tensors (a shared buffer: cloning a bucket does not copy it).
    pub payload: Bytes,
}

/// A complete update as the sender builds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightUpdate {
    /// Header.
    pub header: UpdateHeader,
    /// Buckets in order.
    pub buckets: Vec<Bucket>,
}

/// The wire format code of a storage format.
pub fn format_to_proto(f: Format) -> pb::Format {
    match f {
        Format::Bf16 => pb::Format::Bf16,
        Format::Mxfp8 => pb::Format::Mxfp8,
        Format::Nvfp4 => pb::Format::Nvfp4,
        Format::Fp8Block => pb::Format::Fp8Block,
    }
}

/// The storage format of a wire format code (`None` for unspecified or unknown codes).
pub fn format_from_proto(code: i32) -> Option<Format> {
    Some(match pb::Format::try_from(code).ok()? {
        pb::Format::Bf16 => Format::Bf16,
        pb::Format::Mxfp8 => Format::Mxfp8,
        pb::Format::Nvfp4 => Format::Nvfp4,
        pb::Format::Fp8Block => Format::Fp8Block,
        pb::Format::Unspecified => return None,
    })
}

/// A tensor as its protobuf message (moves the bytes).
pub fn tensor_to_proto(t: WireTensor) -> pb::Tensor {
    pb::Tensor {
        name: t.name,
        format: format_to_proto(t.format) as i32,
        shape: t.shape.iter().map(|&d| d as u64).collect(),
        data: t.data,
        scales: t.scales,
        amax: t.amax,
    }
}

/// A protobuf tensor as a [`WireTensor`]; an unknown format or a dimension that does not fit
/// `usize` is an error naming the tensor.
pub fn tensor_from_proto(t: pb::Tensor) -> Result<WireTensor, String> {
    let format = format_from_proto(t.format)
        .ok_or_else(|| format!("tensor {}: unknown format code {}", t.name, t.format))?;
    let shape = t
        .shape
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| format!("tensor {}: dimension too large in {:?}", t.name, t.shape))?;
    Ok(WireTensor {
        name: t.name,
        format,
        shape,
        data: t.data,
        scales: t.scales,
        amax: t.amax,
    })
}

/// The bucket payload of `tensors`: the encoding of a `TensorList` message.
pub fn encode_tensors(tensors: &[WireTensor]) -> Vec<u8> {
    pb::TensorList {
        tensors: tensors.iter().cloned().map(tensor_to_proto).collect(),
    }
    .encode_to_vec()
}

/// The tensors of a bucket payload (a `TensorList` encoding).
pub fn decode_tensors(payload: &[u8]) -> Result<Vec<WireTensor>, String> {
    pb::TensorList::decode(payload)
        .map_err(|e| format!("malformed tensor list: {e}"))?
        .tensors
        .into_iter()
        .map(tensor_from_proto)
        .collect()
}

/// Encoded size of one tensor inside a `TensorList` (field tag, length prefix and message).
fn encoded_len_in_list(t: &pb::Tensor) -> usize {
    let n = t.encoded_len();
    1 + prost::length_delimiter_len(n) + n
}

pub(crate) fn sha256(b: &[u8]) -> [u8; 32] {
    Sha256::digest(b).into()
}

impl WeightUpdate {
    /// Bucket `tensors` (in order, a tensor never split; a tensor that would take a non-empty
    /// bucket past `bucket_bytes` starts the next one, so a bucket's payload is at most
    /// `max(bucket_bytes, largest single tensor record)`) under `version` and `contract_hash`.
    /// Copies the tensors; [`WeightUpdate::from_tensors`] takes them.
    pub fn build(
        version: u64,
        contract_hash: &str,
        tensors: &[WireTensor],
        bucket_bytes: usize,
    ) -> WeightUpdate {
        Self::from_tensors(version, contract_hash, tensors.to_vec(), bucket_bytes)
    }

    /// [`WeightUpdate::build`] from owned tensors (their bytes are moved into the buckets'
    /// encodings, not copied twice). The buckets are encoded and hashed in parallel; the
    /// result does not depend on it.
    pub fn from_tensors(
        version: u64,
        contract_hash: &str,
        tensors: Vec<WireTensor>,
        bucket_bytes: usize,
    ) -> WeightUpdate {
        let count = tensors.len();
        let mut lists: Vec<Vec<pb::Tensor>> = Vec::new();
        let mut cur: Vec<pb::Tensor> = Vec::new();
        let mut cur_len = 0usize;
        for t in tensors {
            let p = tensor_to_proto(t);
            let n = encoded_len_in_list(&p);
            if !cur.is_empty() && cur_len + n > bucket_bytes {
                lists.push(std::mem::take(&mut cur));
                cur_len = 0;
            }
            cur.push(p);
            cur_len += n;
        }
        if !cur.is_empty() || lists.is_empty() {
            lists.push(cur);
        }
        let buckets: Vec<Bucket> = lists
            .into_par_iter()
            .enumerate()
            .map(|(i, tensors)| {
                let payload = Bytes::from(pb::TensorList { tensors }.encode_to_vec());
                Bucket {
                    index: i as u32,
                    checksum: sha256(&payload),
                    payload,
                }
            })
            .collect();
        WeightUpdate {
            header: UpdateHeader {
                version,
                contract_hash: contract_hash.into(),
                buckets: buckets.len() as u32,
                tensors: count as u32,
                bytes: buckets.iter().map(|b| b.payload.len() as u64).sum(),
            },
            buckets,
        }
    }
}

/// Receiver-side assembly of one update.
#[derive(Debug)]
pub struct UpdateAssembler {
    header: UpdateHeader,
    parts: Vec<Option<Vec<WireTensor>>>,
    admitted: Vec<bool>,
    received: u64,
}

/// Checks bucket `b` of update `version` — the SHA-256 of its payload equals its checksum —
/// and decodes its tensors. On a checksum mismatch the error names the tensors the payload
/// seems to carry (when it still decodes).
///
/// # Errors
/// A checksum mismatch or a malformed payload.
pub fn verify_bucket(version: u64, b: &Bucket) -> Result<Vec<WireTensor>, SyncError> {
    let err = |msg: String| SyncError::Bucket {
        version,
        index: b.index,
        msg,
    };
    if sha256(&b.payload) != b.checksum {
        let carries = match pb::TensorList::decode(&b.payload[..]) {
            Ok(l) if !l.tensors.is_empty() => {
                let names: Vec<&str> = l.tensors.iter().take(4).map(|t| t.name.as_str()).collect();
                let more = l.tensors.len().saturating_sub(names.len());
                format!(
                    " (its payload carries tensor{} {}{})",
                    if l.tensors.len() == 1 { "" } else { "s" },
                    names.join(", "),
                    if more > 0 {
                        format!(" and {more} more")
                    } else {
                        String::new()
                    }
                )
            }
            _ => String::new(),
        };
        return Err(err(format!(
            "SHA-256 of the payload does not match its checksum{carries}"
        )));
    }
    decode_tensors(&b.payload).map_err(err)
}

impl UpdateAssembler {
    /// Start assembling; refuses a header whose contract hash differs from `expected_contract`
    /// or whose counts are inconsistent (no bucket, more buckets than tensors).
    pub fn begin(header: UpdateHeader, expected_contract: &str) -> Result<Self, SyncError> {
        Self::begin_bounded(header, expected_contract, u64::MAX, u64::MAX)
    }

    /// [`UpdateAssembler::begin`] that also refuses, before allocating anything, a header
    /// announcing more than `max_tensors` tensors or `max_bytes` payload bytes. The bucket
    /// count is bounded by the tensor count (a bucket holds at least one tensor), and the
    /// buckets' payloads together may not exceed the announced bytes ([`UpdateAssembler::add`]).
    pub fn begin_bounded(
        header: UpdateHeader,
        expected_contract: &str,
        max_tensors: u64,
        max_bytes: u64,
    ) -> Result<Self, SyncError> {
        let version = header.version;
        if header.contract_hash != expected_contract {
            return Err(SyncError::ContractMismatch {
                version,
                got: header.contract_hash,
                expected: expected_contract.into(),
            });
        }
        let limit = |what, got: u64, limit: u64| SyncError::Limit {
            version,
            what,
            got,
            limit,
        };
        if u64::from(header.tensors) > max_tensors {
            return Err(limit("tensors", header.tensors.into(), max_tensors));
        }
        if header.bytes > max_bytes {
            return Err(limit("bytes", header.bytes, max_bytes));
        }
        let max_buckets = header.tensors.max(1);
        if header.buckets == 0 || header.buckets > max_buckets {
            return Err(SyncError::Bucket {
                version,
                index: 0,
                msg: format!(
                    "header announces {} buckets for {} tensors (expected 1 to {max_buckets})",
                    header.buckets, header.tensors
                ),
            });
        }
        let n = header.buckets as usize;
        Ok(UpdateAssembler {
            header,
            parts: vec![None; n],
            admitted: vec![false; n],
            received: 0,
        })
    }

    /// The header this update started with.
    pub fn header(&self) -> &UpdateHeader {
        &self.header
    }

    /// Verify and store one bucket ([`UpdateAssembler::admit`], [`verify_bucket`],
    /// [`UpdateAssembler::fill`]).
    pub fn add(&mut self, b: &Bucket) -> Result<(), SyncError> {
        self.admit(b.index, b.payload.len())?;
        let tensors = verify_bucket(self.header.version, b)?;
        self.fill(b.index, tensors);
        Ok(())
    }

    /// The checks of bucket `index` that need no look at its payload — the index is in range
    /// and new, and the payloads so far (`len` bytes with this one) stay within the header's
    /// total — recording it as arriving. Its payload is then checked by [`verify_bucket`]
    /// (which may run on another thread, while the next bucket arrives) and stored with
    /// [`UpdateAssembler::fill`]; until then it counts as missing.
    pub fn admit(&mut self, index: u32, len: usize) -> Result<(), SyncError> {
        let version = self.header.version;
        let err = |msg: String| SyncError::Bucket {
            version,
            index,
            msg,
        };
        let i = index as usize;
        if i >= self.parts.len() {
            return Err(err(format!(
                "index out of range (update has {} buckets)",
                self.header.buckets
            )));
        }
        if self.admitted[i] {
            return Err(err("received twice".into()));
        }
        let total = self.received + len as u64;
        if total > self.header.bytes {
            return Err(err(format!(
                "buckets carry {total} payload bytes so far, the header announced {}",
                self.header.bytes
            )));
        }
        self.admitted[i] = true;
        self.received = total;
        Ok(())
    }

    /// Stores the verified tensors of admitted bucket `index`.
    ///
    /// # Panics
    /// `index` was not admitted (a broken invariant of the caller).
    pub fn fill(&mut self, index: u32, tensors: Vec<WireTensor>) {
        let i = index as usize;
        assert!(
            self.admitted[i],
            "bucket {index} filled before it was admitted"
        );
        self.parts[i] = Some(tensors);
    }

    /// All tensors, once every bucket arrived and the tensor count matches.
    pub fn finish(self) -> Result<(u64, Vec<WireTensor>), SyncError> {
        let version = self.header.version;
        let missing = self.parts.iter().filter(|p| p.is_none()).count();
        if missing > 0 {
            return Err(SyncError::Incomplete {
                version,
                missing,
                total: self.parts.len(),
            });
        }
        let tensors: Vec<WireTensor> = self.parts.into_iter().flatten().flatten().collect();
        if tensors.len() != self.header.tensors as usize {
            return Err(SyncError::Bucket {
                version,
                index: self.header.buckets.saturating_sub(1),
                msg: format!(
                    "header announced {} tensors, buckets hold {}",
                    self.header.tensors,
                    tensors.len()
                ),
            });
        }
        Ok((version, tensors))
    }
}

/// A rollout policy plus the weight version it serves and the contract it accepts.
#[derive(Debug)]
pub struct RolloutEngine<P> {
    /// The policy.
    pub policy: P,
    /// Version being served.
    pub version: u64,
    /// Contract hash accepted.
    pub contract_hash: String,
}

/// What applying an update did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApplyReport {
    /// The version now served.
    pub version: u64,
    /// Payload bytes received.
    pub bytes: u64,
    /// Buckets received.
    pub buckets: u32,
}

impl<P: RolloutPolicy> RolloutEngine<P> {
    /// Wrap a policy serving `version`.
    pub fn new(policy: P, version: u64, contract_hash: &str) -> Self {
        RolloutEngine {
            policy,
            version,
            contract_hash: contract_hash.into(),
        }
    }

    /// Apply a complete, verified set of tensors as `version` (atomic: on error nothing
    /// changes).
    pub fn install(&mut self, version: u64, tensors: &[WireTensor]) -> Result<(), SyncError> {
        if version <= self.version {
            return Err(SyncError::Stale {
                got: version,
                current: self.version,
            });
        }
        self.policy
            .load_weights_versioned(version, tensors)
            .map_err(|error| SyncError::Policy { version, error })?;
        self.version = version;
        Ok(())
    }

    /// Verify and apply an update: refused when made under another contract or not newer
    /// than the served version; a policy that takes updates as they are
    /// ([`RolloutPolicy::load_update`], a rollout server) verifies and applies it where the
    /// weights live; otherwise every bucket is verified and decoded here and the tensors are
    /// installed ([`RolloutEngine::install`]).
    pub fn apply(&mut self, u: &WeightUpdate) -> Result<ApplyReport, SyncError> {
        let version = u.header.version;
        if u.header.contract_hash != self.contract_hash {
            return Err(SyncError::ContractMismatch {
                version,
                got: u.header.contract_hash.clone(),
                expected: self.contract_hash.clone(),
            });
        }
        if version <= self.version {
            return Err(SyncError::Stale {
                got: version,
                current: self.version,
            });
        }
        if let Some(r) = self.policy.load_update(u) {
            r.map_err(|error| SyncError::Policy { version, error })?;
            self.version = version;
            return Ok(ApplyReport {
                version,
                bytes: u.header.bytes,
                buckets: u.header.buckets,
            });
        }
        let mut a = UpdateAssembler::begin(u.header.clone(), &self.contract_hash)?;
        for b in &u.buckets {
            a.add(b)?;
        }
        let (version, tensors) = a.finish()?;
        self.install(version, &tensors)?;
        Ok(ApplyReport {
            version,
            bytes: u.header.bytes,
            buckets: u.header.buckets,
        })
    }

    /// Installs an update that stayed on the device as `version` (`None`: the policy does not
    /// take this kind of update; nothing changed).
    pub fn apply_local(
        &mut self,
        version: u64,
        update: &mut crate::policy::LocalExport,
    ) -> Option<Result<ApplyReport, SyncError>> {
        if version <= self.version {
            return Some(Err(SyncError::Stale {
                got: version,
                current: self.version,
            }));
        }
        let r = self.policy.load_local(version, update)?;
        Some(
            r.map_err(|error| SyncError::Policy { version, error })
                .map(|()| {
                    self.version = version;
                    ApplyReport {
                        version,
                        bytes: update.bytes,
                        buckets: 0,
                    }
                }),
        )
    }

    /// `--check-weight-sync`: the rollout's bytes equal `expected` (the trainer's export),
    /// tensor by tensor.
    pub fn check(&self, expected: &[WireTensor]) -> Result<(), SyncError> {
        self.policy.check_weights(expected)
    }
}

/// Compare two weight sets byte for byte.
pub fn check_equal(got: &[WireTensor], expected: &[WireTensor]) -> Result<(), SyncError> {
    if got.len() != expected.len() {
        return Err(SyncError::CheckFailed {
            name: "*".into(),
            msg: format!("{} tensors held, {} exported", got.len(), expected.len()),
        });
    }
    for (g, e) in got.iter().zip(expected) {
        let fail = |msg: &str| SyncError::CheckFailed {
            name: e.name.clone(),
            msg: msg.into(),
        };
        if g.name != e.name || g.format != e.format || g.shape != e.shape {
            return Err(fail(&format!(
                "held `{}` {} {:?}, exported {} {:?}",
                g.name, g.format, g.shape, e.format, e.shape
            )));
        }
        if g.data != e.data {
            let at = g.data.iter().zip(&e.data).position(|(a, b)| a != b);
            return Err(fail(&format!("data bytes differ (first at {at:?})")));
        }
        if g.scales != e.scales {
            return Err(fail("scale bytes differ"));
        }
        let ga: Vec<u32> = g.amax.iter().map(|x| x.to_bits()).collect();
        let ea: Vec<u32> = e.amax.iter().map(|x| x.to_bits()).collect();
        if ga != ea {
            return Err(fail("amax differs"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::TrainPolicy;
    use crate::tabular::{TabularShape, TabularTrainer};

    fn trainer(seed: f32) -> TabularTrainer {
        let mut t = TabularTrainer::new(
            TabularShape {
                buckets: 4,
                max_len: 4,
                vocab: 64,
            },
            Format::Bf16,
        );
        for p in t.params() {
            for (i, v) in p.value.iter_mut().enumerate() {
                *v = (i as f32 * 0.1 + seed).sin();
            }
        }
        t
    }

    fn tensors(n: usize) -> Vec<WireTensor> {
        (0..n)
            .map(|i| WireTensor {
                name: format!("t{i}"),
                format: Format::Bf16,
                shape: vec![2, 4],
                data: vec![i as u8; 16],
                scales: vec![],
                amax: vec![],
            })
            .collect()
    }

    #[test]
    fn buckets_round_trip_and_respect_size() {
        let ts = tensors(5);
        let u = WeightUpdate::build(3, "h", &ts, 60);
        assert!(u.buckets.len() >= 3, "{}", u.buckets.len());
        let mut a = UpdateAssembler::begin(u.header.clone(), "h").unwrap();
        for b in &u.buckets {
            a.add(b).unwrap();
        }
        assert_eq!(a.finish().unwrap(), (3, ts));
    }

    #[test]
    fn applied_bytes_equal_exported_bytes() {
        let t0 = trainer(0.0);
        let mut eng = RolloutEngine::new(t0.rollout().unwrap(), 0, "h");
        let t1 = trainer(1.0);
        let ex = t1.export_weights().unwrap();
        assert!(eng.check(&ex).is_err());
        let rep = eng
            .apply(&WeightUpdate::build(1, "h", &ex, 1 << 10))
            .unwrap();
        assert_eq!(rep.version, 1);
        eng.check(&ex).unwrap();
        assert_eq!(eng.policy.weights()[0].data, ex[0].data);
    }

    #[test]
    fn contract_hash_mismatch_is_refused_and_changes_nothing() {
        let t0 = trainer(0.0);
        let before = t0.export_weights().unwrap();
        let mut eng = RolloutEngine::new(t0.rollout().unwrap(), 0, "contract-a");
        let ex = trainer(1.0).export_weights().unwrap();
        let e = eng
            .apply(&WeightUpdate::build(1, "contract-b", &ex, 1 << 10))
            .unwrap_err();
        assert!(matches!(e, SyncError::ContractMismatch { .. }), "{e}");
        assert!(e.to_string().contains("contract-b") && e.to_string().contains("contract-a"));
        assert_eq!(eng.version, 0);
        eng.check(&before).unwrap();
    }

    #[test]
    fn corrupt_or_missing_bucket_changes_nothing() {
        let t0 = trainer(0.0);
        let before = t0.export_weights().unwrap();
        let mut eng = RolloutEngine::new(t0.rollout().unwrap(), 0, "h");
        let ex = trainer(1.0).export_weights().unwrap();
        let mut u = WeightUpdate::build(1, "h", &ex, 1 << 10);
        let mut p = u.buckets[0].payload.to_vec();
        p[40] ^= 1;
        u.buckets[0].payload = p.into();
        assert!(matches!(eng.apply(&u), Err(SyncError::Bucket { .. })));
        // A header announcing more buckets than tensors is refused before anything is
        // allocated; one whose bucket never arrives is incomplete.
        let mut u2 = WeightUpdate::build(1, "h", &ex, 1 << 10);
        u2.header.buckets += 1;
        let e = eng.apply(&u2).unwrap_err();
        assert!(
            e.to_string().contains("announces 2 buckets for 1 tensors"),
            "{e}"
        );
        let mut u3 = WeightUpdate::build(1, "h", &ex, 1 << 10);
        u3.buckets.clear();
        assert!(matches!(eng.apply(&u3), Err(SyncError::Incomplete { .. })));
        // A well-formed update whose tensor has the wrong shape is refused by the policy.
        let mut bad = ex.clone();
        bad[0].shape = vec![1, 1];
        let e = eng
            .apply(&WeightUpdate::build(1, "h", &bad, 1 << 10))
            .unwrap_err();
        assert!(matches!(e, SyncError::Policy { .. }), "{e}");
        // Said once: the version and the policy's message, and no separate cause repeating it.
        assert!(
            e.to_string().starts_with("weight update v1: expected"),
            "{e}"
        );
        assert!(std::error::Error::source(&e).is_none(), "{e}");
        assert_eq!(eng.version, 0);
        eng.check(&before).unwrap();
    }
}
