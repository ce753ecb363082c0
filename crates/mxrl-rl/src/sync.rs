//! Live weight sync: trainer → rollout, quantized once, bucketed, versioned, verified.
//!
//! An update is a [`UpdateHeader`] (version, contract hash, bucket count, tensor count, total
//! bytes) plus buckets; each bucket carries a SHA-256 of its payload (a run of serialized
//! [`WireTensor`]s, never split). The receiver ([`UpdateAssembler`]) checks the contract hash
//! first (a mismatch is refused), then every bucket's index and checksum, then completeness; only
//! then does the rollout engine swap its weights ([`RolloutEngine::apply`]), and the policy's
//! `load_weights` validates every tensor before it changes anything. A failed or partial update
//! leaves the rollout serving the previous version and is reported as an error.
//!
//! Over a socket ([`write_update`] / [`read_update`]) the same messages travel as frames
//! ([`write_frame`] / [`read_frame`]): `b"MXWU" | kind: u8 | len: u64 LE | payload`, kinds
//! [`K_HEADER`] (JSON), [`K_BUCKET`] (`index: u32 LE | sha256: [u8; 32] | payload`),
//! [`K_COMMIT`] (`version: u64 LE`), [`K_ACK`] (JSON). The rollout server
//! ([`crate::server`]) adds request/response kinds on the same framing.

use crate::policy::{PolicyError, RolloutPolicy, WireTensor};
use mxrl_formats::Format;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};

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
    #[error("weight update v{version}: {source}")]
    Policy {
        /// Update version.
        version: u64,
        /// The policy's error.
        source: PolicyError,
    },
    /// Transport failure (connection dropped mid-update, bad frame).
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
    /// Serialized tensors.
    pub payload: Vec<u8>,
}

/// A complete update as the sender builds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightUpdate {
    /// Header.
    pub header: UpdateHeader,
    /// Buckets in order.
    pub buckets: Vec<Bucket>,
}

fn format_code(f: Format) -> u8 {
    match f {
        Format::Bf16 => 0,
        Format::Mxfp8 => 1,
        Format::Nvfp4 => 2,
        Format::Fp8Block => 3,
    }
}

fn format_from_code(c: u8) -> Option<Format> {
    Some(match c {
        0 => Format::Bf16,
        1 => Format::Mxfp8,
        2 => Format::Nvfp4,
        3 => Format::Fp8Block,
        _ => return None,
    })
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

pub(crate) fn serialize_tensor(t: &WireTensor, out: &mut Vec<u8>) {
    put_bytes(out, t.name.as_bytes());
    out.push(format_code(t.format));
    out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
    for &d in &t.shape {
        out.extend_from_slice(&(d as u64).to_le_bytes());
    }
    put_bytes(out, &t.data);
    put_bytes(out, &t.scales);
    let amax: Vec<u8> = t.amax.iter().flat_map(|a| a.to_le_bytes()).collect();
    put_bytes(out, &amax);
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let s = self.b.get(self.at..end)?;
        self.at = end;
        Some(s)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = usize::try_from(self.u64()?).ok()?;
        self.take(n)
    }
}

pub(crate) fn deserialize_tensors(payload: &[u8]) -> Option<Vec<WireTensor>> {
    let mut c = Cursor { b: payload, at: 0 };
    let mut out = Vec::new();
    while c.at < payload.len() {
        let name = String::from_utf8(c.bytes()?.to_vec()).ok()?;
        let format = format_from_code(*c.take(1)?.first()?)?;
        let nd = c.u32()? as usize;
        let mut shape = Vec::with_capacity(nd.min(8));
        for _ in 0..nd {
            shape.push(usize::try_from(c.u64()?).ok()?);
        }
        let data = c.bytes()?.to_vec();
        let scales = c.bytes()?.to_vec();
        let amax_b = c.bytes()?;
        if amax_b.len() % 4 != 0 {
            return None;
        }
        let amax = amax_b
            .chunks_exact(4)
            .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
            .collect();
        out.push(WireTensor {
            name,
            format,
            shape,
            data,
            scales,
            amax,
        });
    }
    Some(out)
}

pub(crate) fn sha256(b: &[u8]) -> [u8; 32] {
    Sha256::digest(b).into()
}

impl WeightUpdate {
    /// Bucket `tensors` (in order, a tensor never split; a bucket closes once it reaches
    /// `bucket_bytes`) under `version` and `contract_hash`.
    pub fn build(
        version: u64,
        contract_hash: &str,
        tensors: &[WireTensor],
        bucket_bytes: usize,
    ) -> WeightUpdate {
        let mut buckets = Vec::new();
        let mut cur = Vec::new();
        for t in tensors {
            serialize_tensor(t, &mut cur);
            if cur.len() >= bucket_bytes {
                buckets.push(std::mem::take(&mut cur));
            }
        }
        if !cur.is_empty() || buckets.is_empty() {
            buckets.push(cur);
        }
        let buckets: Vec<Bucket> = buckets
            .into_iter()
            .enumerate()
            .map(|(i, payload)| Bucket {
                index: i as u32,
                checksum: sha256(&payload),
                payload,
            })
            .collect();
        WeightUpdate {
            header: UpdateHeader {
                version,
                contract_hash: contract_hash.into(),
                buckets: buckets.len() as u32,
                tensors: tensors.len() as u32,
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
}

impl UpdateAssembler {
    /// Start assembling; refuses a header whose contract hash differs from `expected_contract`.
    pub fn begin(header: UpdateHeader, expected_contract: &str) -> Result<Self, SyncError> {
        if header.contract_hash != expected_contract {
            return Err(SyncError::ContractMismatch {
                version: header.version,
                got: header.contract_hash,
                expected: expected_contract.into(),
            });
        }
        let n = header.buckets as usize;
        Ok(UpdateAssembler {
            header,
            parts: vec![None; n],
        })
    }

    /// Verify and store one bucket.
    pub fn add(&mut self, b: &Bucket) -> Result<(), SyncError> {
        let version = self.header.version;
        let err = |msg: String| SyncError::Bucket {
            version,
            index: b.index,
            msg,
        };
        let slot = self.parts.get_mut(b.index as usize).ok_or_else(|| {
            err(format!(
                "index out of range (update has {} buckets)",
                self.header.buckets
            ))
        })?;
        if slot.is_some() {
            return Err(err("received twice".into()));
        }
        if sha256(&b.payload) != b.checksum {
            return Err(err(
                "SHA-256 of the payload does not match its checksum".into()
            ));
        }
        *slot = Some(
            deserialize_tensors(&b.payload).ok_or_else(|| err("malformed tensor record".into()))?,
        );
        Ok(())
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
            .map_err(|source| SyncError::Policy { version, source })?;
        self.version = version;
        Ok(())
    }

    /// Verify and apply an in-process update.
    pub fn apply(&mut self, u: &WeightUpdate) -> Result<ApplyReport, SyncError> {
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

const MAGIC: &[u8; 4] = b"MXWU";
/// Frame kind: update header (JSON [`UpdateHeader`]).
pub const K_HEADER: u8 = 1;
/// Frame kind: one bucket (`index: u32 LE | sha256: [u8; 32] | payload`).
pub const K_BUCKET: u8 = 2;
/// Frame kind: end of an update (`version: u64 LE`).
pub const K_COMMIT: u8 = 3;
/// Frame kind: the receiver's answer to an update (JSON [`Ack`]).
pub const K_ACK: u8 = 4;
/// Largest frame accepted (guards against a corrupt length).
pub const MAX_FRAME: u64 = 1 << 34;

fn tr<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> SyncError + '_ {
    move |e| SyncError::Transport(format!("{what}: {e}"))
}

/// Write one frame `b"MXWU" | kind | len: u64 LE | parts...` (not flushed).
pub fn write_frame<W: Write>(w: &mut W, kind: u8, parts: &[&[u8]]) -> Result<(), SyncError> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    w.write_all(MAGIC).map_err(tr("write"))?;
    w.write_all(&[kind]).map_err(tr("write"))?;
    w.write_all(&(len as u64).to_le_bytes())
        .map_err(tr("write"))?;
    for p in parts {
        w.write_all(p).map_err(tr("write"))?;
    }
    Ok(())
}

/// Read one frame: `(kind, payload)`. A connection closed before or inside the frame is a
/// [`SyncError::Transport`] error.
pub fn read_frame<R: Read>(r: &mut R) -> Result<(u8, Vec<u8>), SyncError> {
    read_frame_opt(r)?.ok_or_else(|| {
        SyncError::Transport("connection closed before a complete frame header".into())
    })
}

/// Read one frame, or `None` when the peer closed the connection cleanly at a frame boundary.
pub fn read_frame_opt<R: Read>(r: &mut R) -> Result<Option<(u8, Vec<u8>)>, SyncError> {
    let mut head = [0u8; 13];
    let first = loop {
        match r.read(&mut head[..1]) {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(SyncError::Transport(format!("reading a frame header: {e}"))),
        }
    };
    if first == 0 {
        return Ok(None);
    }
    r.read_exact(&mut head[1..])
        .map_err(tr("connection closed before a complete frame header"))?;
    if &head[..4] != MAGIC {
        return Err(SyncError::Transport(format!(
            "bad frame magic {:02x?}",
            &head[..4]
        )));
    }
    let len = u64::from_le_bytes(head[5..13].try_into().expect("8 bytes"));
    if len > MAX_FRAME {
        return Err(SyncError::Transport(format!(
            "frame of {len} bytes exceeds the limit"
        )));
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload)
        .map_err(tr("connection closed in the middle of a frame"))?;
    Ok(Some((head[4], payload)))
}

/// The receiver's answer to an update.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ack {
    /// Version now served.
    pub version: u64,
    /// Error message when the update was refused.
    pub error: Option<String>,
}

/// Send an update and wait for the receiver's [`Ack`].
pub fn write_update<S: Read + Write>(s: &mut S, u: &WeightUpdate) -> Result<Ack, SyncError> {
    let h = serde_json::to_vec(&u.header).map_err(tr("header"))?;
    write_frame(s, K_HEADER, &[&h])?;
    for b in &u.buckets {
        write_frame(
            s,
            K_BUCKET,
            &[&b.index.to_le_bytes(), &b.checksum, &b.payload],
        )?;
    }
    write_frame(s, K_COMMIT, &[&u.header.version.to_le_bytes()])?;
    s.flush().map_err(tr("flush"))?;
    let (k, p) = read_frame(s)?;
    if k != K_ACK {
        return Err(SyncError::Transport(format!(
            "expected an ack frame, got kind {k}"
        )));
    }
    let ack: Ack = serde_json::from_slice(&p).map_err(tr("ack"))?;
    match &ack.error {
        Some(e) => Err(SyncError::Rejected(e.clone())),
        None => Ok(ack),
    }
}

/// Receive one update from `s` into `engine`, verify it, apply it atomically and answer with
/// an [`Ack`] (best effort: the connection may already be gone). A dropped connection or any
/// verification failure leaves the engine serving its previous version.
pub fn read_update<S: Read + Write, P: RolloutPolicy>(
    s: &mut S,
    engine: &mut RolloutEngine<P>,
) -> Result<ApplyReport, SyncError> {
    let result = (|| {
        let (k, p) = read_frame(s)?;
        if k != K_HEADER {
            return Err(SyncError::Transport(format!(
                "expected a header frame, got kind {k}"
            )));
        }
        let header: UpdateHeader = serde_json::from_slice(&p).map_err(tr("header"))?;
        let (bytes, buckets) = (header.bytes, header.buckets);
        let mut a = UpdateAssembler::begin(header, &engine.contract_hash)?;
        loop {
            let (k, p) = read_frame(s)?;
            match k {
                K_BUCKET if p.len() >= 36 => {
                    let b = Bucket {
                        index: u32::from_le_bytes(p[..4].try_into().expect("4 bytes")),
                        checksum: p[4..36].try_into().expect("32 bytes"),
                        payload: p[36..].to_vec(),
                    };
                    a.add(&b)?;
                }
                K_COMMIT => break,
                other => {
                    return Err(SyncError::Transport(format!(
                        "unexpected frame kind {other} ({} bytes)",
                        p.len()
                    )))
                }
            }
        }
        let (version, tensors) = a.finish()?;
        engine.install(version, &tensors)?;
        Ok(ApplyReport {
            version,
            bytes,
            buckets,
        })
    })();
    let ack = Ack {
        version: engine.version,
        error: result.as_ref().err().map(|e| e.to_string()),
    };
    if let Ok(j) = serde_json::to_vec(&ack) {
        let _ = write_frame(s, K_ACK, &[&j]).and_then(|_| s.flush().map_err(tr("flush")));
    }
    result
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
        u.buckets[0].payload[40] ^= 1;
        assert!(matches!(eng.apply(&u), Err(SyncError::Bucket { .. })));
        let mut u2 = WeightUpdate::build(1, "h", &ex, 1 << 10);
        u2.header.buckets += 1;
        assert!(matches!(eng.apply(&u2), Err(SyncError::Incomplete { .. })));
        // A well-formed update whose tensor has the wrong shape is refused by the policy.
        let mut bad = ex.clone();
        bad[0].shape = vec![1, 1];
        assert!(matches!(
            eng.apply(&WeightUpdate::build(1, "h", &bad, 1 << 10)),
            Err(SyncError::Policy { .. })
        ));
        assert_eq!(eng.version, 0);
        eng.check(&before).unwrap();
    }

    #[test]
    fn socket_update_applies_and_dropped_connection_changes_nothing() {
        use std::os::unix::net::UnixStream;
        let t0 = trainer(0.0);
        let before = t0.export_weights().unwrap();
        let ex = trainer(1.0).export_weights().unwrap();
        let u = WeightUpdate::build(1, "h", &ex, 256);

        // 1. A sender that dies in the middle of the bucket frame.
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let partial = u.clone();
        let sender = std::thread::spawn(move || {
            let h = serde_json::to_vec(&partial.header).unwrap();
            write_frame(&mut a, K_HEADER, &[&h]).unwrap();
            let b0 = &partial.buckets[0];
            let mut frame = Vec::new();
            write_frame(
                &mut frame,
                K_BUCKET,
                &[&b0.index.to_le_bytes(), &b0.checksum, &b0.payload],
            )
            .unwrap();
            a.write_all(&frame[..frame.len() / 2]).unwrap();
            drop(a);
        });
        let mut eng = RolloutEngine::new(t0.rollout().unwrap(), 0, "h");
        let e = read_update(&mut b, &mut eng).unwrap_err();
        sender.join().unwrap();
        assert!(matches!(e, SyncError::Transport(_)), "{e}");
        assert_eq!(eng.version, 0);
        eng.check(&before).unwrap();

        // 2. A full update over TCP on the loopback interface.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let full = u.clone();
        let sender = std::thread::spawn(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            write_update(&mut s, &full)
        });
        let (mut s, _) = l.accept().unwrap();
        let rep = read_update(&mut s, &mut eng).unwrap();
        let ack = sender.join().unwrap().unwrap();
        assert_eq!((rep.version, ack.version), (1, 1));
        eng.check(&ex).unwrap();

        // 3. A stale version is rejected and the sender hears why.
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let stale = u.clone();
        let sender = std::thread::spawn(move || write_update(&mut a, &stale));
        assert!(matches!(
            read_update(&mut b, &mut eng),
            Err(SyncError::Stale { .. })
        ));
        let e = sender.join().unwrap().unwrap_err();
        assert!(e.to_string().contains("not newer"), "{e}");
    }
}
