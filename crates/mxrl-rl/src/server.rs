//! The rollout engine in its own process: a server that serves any [`RolloutPolicy`] over a
//! byte stream (Unix socket or TCP), and [`RemoteRollout`], a client that is itself a
//! [`RolloutPolicy`], so the RL loop ([`crate::runner::RlRun`]) drives a rollout engine in
//! another process without knowing it.
//!
//! # Protocol
//!
//! Every message is a frame of the weight-sync framing ([`crate::sync::write_frame`]):
//! `b"MXWU" | kind: u8 | len: u64 LE | payload`. A connection carries any number of
//! exchanges, one at a time; the client always speaks first and the server answers each
//! request with exactly one frame.
//!
//! | request (client → server) | payload | answer (server → client) |
//! |---|---|---|
//! | [`K_INFO`] (5) | empty | [`K_INFO_REPLY`] (6): JSON [`ServerInfo`] |
//! | [`K_GENERATE`] (7) | binary generate request | [`K_SAMPLES`] (8): `version: u64` + samples |
//! | [`K_SCORE`] (9) | binary score request | [`K_LOGPROBS`] (10): `version: u64` + logprobs |
//! | [`K_DIGEST`] (11) | empty | [`K_DIGEST_REPLY`] (12): JSON [`WeightsDigest`] |
//! | [`K_FETCH`] (13) | empty | [`K_WEIGHTS`] (14): `version: u64` + serialized tensors |
//! | [`K_SHUTDOWN`] (15) | empty | [`K_BYE`] (16): empty; the server stops accepting |
//! | weight update: [`K_HEADER`] (1), [`K_BUCKET`] (2) × n, [`K_COMMIT`] (3) | as in [`crate::sync`] | [`K_ACK`] (4): JSON [`Ack`] |
//!
//! A request the server cannot carry out is answered with [`K_ERROR`] (17, UTF-8 message);
//! the connection stays usable. Binary payloads are little-endian: a `u32`/`f32` list is
//! `count: u64` then the values (f32 as IEEE bits, so logprobs and routing weights cross the
//! socket exactly); an optional routing trace or probe set is a `0`/`1` byte then its fields.
//! Weight buckets keep the binary tensor records of [`crate::sync`].
//!
//! # Weight updates and failures
//!
//! The server checks an update exactly as the in-process [`RolloutEngine`] does: the header's
//! contract hash must equal the server's (else the update is refused), every bucket's SHA-256
//! and index are verified, the commit must name the header's version, all buckets must be
//! present, the version must be newer than the one served, and the policy validates every
//! tensor before it swaps anything. Buckets are assembled outside the engine's lock, so
//! generation continues on the old version while an update streams in.
//!
//! - A refused update (bad hash, checksum, stale version, wrong tensors) is drained up to its
//!   commit frame and answered with an [`Ack`] carrying the error and the version still served;
//!   the connection stays in sync and usable.
//! - A connection that drops mid-update (before the commit frame) changes nothing: the partial
//!   update is discarded and the server keeps serving its previous version to every client.
//! - The weight version only advances: a server that served a run up to version `v` refuses a
//!   new run's version 1. Start a fresh server per run (`mxrl rl --rollout spawn` does).
//!
//! `--check-weight-sync` over the socket compares per-tensor SHA-256 digests of data, scales
//! and amax computed by the server from the bytes it holds ([`K_DIGEST`]) with digests of the
//! trainer's export; [`K_FETCH`] returns the held bytes themselves.

use crate::policy::{
    LayerProbes, PolicyError, RolloutPolicy, RoutingTrace, Sample, SamplingConfig, TrainSeq,
    WireTensor,
};
use crate::sync::{
    deserialize_tensors, read_frame, read_frame_opt, serialize_tensor, sha256, write_frame,
    write_update, Ack, ApplyReport, Bucket, RolloutEngine, SyncError, UpdateAssembler,
    UpdateHeader, WeightUpdate, K_ACK, K_BUCKET, K_COMMIT, K_HEADER,
};
use mxrl_formats::Format;
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Frame kind: server information request (empty).
pub const K_INFO: u8 = 5;
/// Frame kind: server information (JSON [`ServerInfo`]).
pub const K_INFO_REPLY: u8 = 6;
/// Frame kind: generate request (binary).
pub const K_GENERATE: u8 = 7;
/// Frame kind: generated samples (binary).
pub const K_SAMPLES: u8 = 8;
/// Frame kind: score request (binary).
pub const K_SCORE: u8 = 9;
/// Frame kind: scored logprobs (binary).
pub const K_LOGPROBS: u8 = 10;
/// Frame kind: weight digest request (empty).
pub const K_DIGEST: u8 = 11;
/// Frame kind: weight digests (JSON [`WeightsDigest`]).
pub const K_DIGEST_REPLY: u8 = 12;
/// Frame kind: weight fetch request (empty).
pub const K_FETCH: u8 = 13;
/// Frame kind: held weights (`version: u64 LE` + serialized tensors).
pub const K_WEIGHTS: u8 = 14;
/// Frame kind: shutdown request (empty).
pub const K_SHUTDOWN: u8 = 15;
/// Frame kind: shutdown acknowledged (empty).
pub const K_BYE: u8 = 16;
/// Frame kind: a request failed (UTF-8 message).
pub const K_ERROR: u8 = 17;

/// Protocol revision reported in [`ServerInfo`].
pub const PROTOCOL: u32 = 1;

/// Errors of the rollout server and its client. Every message names the peer.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// An address that is neither `unix:PATH` nor `tcp:HOST:PORT`.
    #[error("rollout address `{0}`: expected unix:PATH or tcp:HOST:PORT")]
    Address(String),
    /// A socket operation failed.
    #[error("rollout server {peer}: {what}: {msg}")]
    Io {
        /// The peer or listening address.
        peer: String,
        /// What was being done.
        what: String,
        /// The error.
        msg: String,
    },
    /// The peer sent something other than what the protocol expects.
    #[error("rollout server {peer}: {msg}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What was expected and what arrived.
        msg: String,
    },
    /// The server could not carry out a request.
    #[error("rollout server {peer}: {request} failed: {msg}")]
    Remote {
        /// The server.
        peer: String,
        /// The request.
        request: String,
        /// The server's message.
        msg: String,
    },
    /// The server refused a weight update; it still serves `serving`.
    #[error(
        "rollout server {peer} refused weight update v{version} (still serving v{serving}): {msg}"
    )]
    Refused {
        /// The server.
        peer: String,
        /// Version of the refused update.
        version: u64,
        /// Version the server serves.
        serving: u64,
        /// The server's reason.
        msg: String,
    },
    /// The server was built under another quantizer contract.
    #[error("rollout server {peer} uses quantizer contract {server}, this side {ours}; refusing to use it")]
    Contract {
        /// The server.
        peer: String,
        /// The server's contract hash.
        server: String,
        /// Ours.
        ours: String,
    },
}

/// Where a rollout server listens: `unix:PATH` or `tcp:HOST:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A Unix domain socket at this path.
    Unix(PathBuf),
    /// A TCP address `HOST:PORT`.
    Tcp(String),
}

impl std::str::FromStr for Endpoint {
    type Err = ServerError;
    fn from_str(s: &str) -> Result<Self, ServerError> {
        if let Some(p) = s.strip_prefix("unix:") {
            if !p.is_empty() {
                return Ok(Endpoint::Unix(PathBuf::from(p)));
            }
        } else if let Some(a) = s.strip_prefix("tcp:") {
            if let Some((h, port)) = a.rsplit_once(':') {
                if !h.is_empty() && port.parse::<u16>().is_ok() {
                    return Ok(Endpoint::Tcp(a.to_string()));
                }
            }
        }
        Err(ServerError::Address(s.to_string()))
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
            Endpoint::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

/// A connected byte stream (either transport).
#[derive(Debug)]
pub enum Stream {
    /// Unix domain socket.
    Unix(UnixStream),
    /// TCP (Nagle off).
    Tcp(TcpStream),
}

impl Stream {
    /// Connect to `ep`.
    pub fn connect(ep: &Endpoint) -> Result<Stream, ServerError> {
        let io = |e: std::io::Error| ServerError::Io {
            peer: ep.to_string(),
            what: "connect".into(),
            msg: e.to_string(),
        };
        Ok(match ep {
            Endpoint::Unix(p) => Stream::Unix(UnixStream::connect(p).map_err(io)?),
            Endpoint::Tcp(a) => {
                let s = TcpStream::connect(a.as_str()).map_err(io)?;
                s.set_nodelay(true).map_err(io)?;
                Stream::Tcp(s)
            }
        })
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Unix(s) => s.flush(),
            Stream::Tcp(s) => s.flush(),
        }
    }
}

/// What a server says about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerInfo {
    /// Protocol revision ([`PROTOCOL`]).
    pub protocol: u32,
    /// Weight version served now.
    pub version: u64,
    /// Quantizer contract hash the server accepts.
    pub contract_hash: String,
    /// Precision recipe the server was started with.
    pub recipe: String,
    /// Model the server was started with.
    pub model: String,
    /// Tensors held.
    pub tensors: usize,
    /// Weight bytes held (data + scales + amax).
    pub weight_bytes: u64,
}

/// SHA-256 digests of one held tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorDigest {
    /// Tensor name.
    pub name: String,
    /// Storage format.
    pub format: Format,
    /// Logical shape.
    pub shape: Vec<usize>,
    /// SHA-256 of the element bytes (hex).
    pub data: String,
    /// SHA-256 of the scale bytes (hex).
    pub scales: String,
    /// SHA-256 of the amax values' little-endian bytes (hex).
    pub amax: String,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl TensorDigest {
    /// Digests of `t`.
    pub fn of(t: &WireTensor) -> TensorDigest {
        let amax: Vec<u8> = t.amax.iter().flat_map(|a| a.to_le_bytes()).collect();
        TensorDigest {
            name: t.name.clone(),
            format: t.format,
            shape: t.shape.clone(),
            data: hex(&sha256(&t.data)),
            scales: hex(&sha256(&t.scales)),
            amax: hex(&sha256(&amax)),
        }
    }
}

/// Digests of all held tensors and the version they belong to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightsDigest {
    /// Version served.
    pub version: u64,
    /// One entry per tensor, in the policy's order.
    pub tensors: Vec<TensorDigest>,
}

/// Compare a server's digests with the digests of `expected` (the trainer's export).
pub fn check_digests(
    peer: &str,
    got: &WeightsDigest,
    expected: &[WireTensor],
) -> Result<(), SyncError> {
    if got.tensors.len() != expected.len() {
        return Err(SyncError::CheckFailed {
            name: "*".into(),
            msg: format!(
                "rollout server {peer} holds {} tensors, {} exported",
                got.tensors.len(),
                expected.len()
            ),
        });
    }
    for (g, e) in got.tensors.iter().zip(expected) {
        let fail = |msg: String| SyncError::CheckFailed {
            name: e.name.clone(),
            msg: format!("{msg} (rollout server {peer}, v{})", got.version),
        };
        if g.name != e.name || g.format != e.format || g.shape != e.shape {
            return Err(fail(format!(
                "held `{}` {} {:?}, exported {} {:?}",
                g.name, g.format, g.shape, e.format, e.shape
            )));
        }
        let want = TensorDigest::of(e);
        for (part, a, b) in [
            ("data", &g.data, &want.data),
            ("scale", &g.scales, &want.scales),
            ("amax", &g.amax, &want.amax),
        ] {
            if a != b {
                return Err(fail(format!(
                    "{part} bytes differ: held sha256 {a}, exported sha256 {b}"
                )));
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Binary payloads.

#[derive(Default)]
struct Enc(Vec<u8>);

impl Enc {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn len(&mut self, v: usize) {
        self.u64(v as u64);
    }
    fn f32(&mut self, v: f32) {
        self.u32(v.to_bits());
    }
    fn u32s(&mut self, v: &[u32]) {
        self.len(v.len());
        for &x in v {
            self.u32(x);
        }
    }
    fn f32s(&mut self, v: &[f32]) {
        self.len(v.len());
        for &x in v {
            self.f32(x);
        }
    }
    fn routing(&mut self, r: Option<&RoutingTrace>) {
        match r {
            None => self.u8(0),
            Some(t) => {
                self.u8(1);
                self.len(t.layers);
                self.len(t.top_k);
                self.u32s(&t.ids);
                self.f32s(&t.weights);
            }
        }
    }
    fn probes(&mut self, p: Option<&LayerProbes>) {
        match p {
            None => self.u8(0),
            Some(p) => {
                self.u8(1);
                self.len(p.layers);
                self.len(p.width);
                self.f32s(&p.values);
            }
        }
    }
}

struct Dec<'a> {
    b: &'a [u8],
    at: usize,
    what: &'static str,
}

impl<'a> Dec<'a> {
    fn new(b: &'a [u8], what: &'static str) -> Self {
        Dec { b, at: 0, what }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let Some(end) = end else {
            return Err(format!(
                "{}: truncated at byte {} of {} (needed {n} more)",
                self.what,
                self.at,
                self.b.len()
            ));
        };
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn len(&mut self) -> Result<usize, String> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| format!("{}: count {v} too large", self.what))
    }
    /// A count of `width`-byte items that must fit in the rest of the payload.
    fn count(&mut self, width: usize) -> Result<usize, String> {
        let n = self.len()?;
        let left = self.b.len() - self.at;
        if n.checked_mul(width).is_none_or(|need| need > left) {
            return Err(format!(
                "{}: count {n} at byte {} exceeds the {left} bytes left",
                self.what, self.at
            ));
        }
        Ok(n)
    }
    fn f32(&mut self) -> Result<f32, String> {
        Ok(f32::from_bits(self.u32()?))
    }
    fn u32s(&mut self) -> Result<Vec<u32>, String> {
        let n = self.count(4)?;
        (0..n).map(|_| self.u32()).collect()
    }
    fn f32s(&mut self) -> Result<Vec<f32>, String> {
        let n = self.count(4)?;
        (0..n).map(|_| self.f32()).collect()
    }
    fn flag(&mut self) -> Result<bool, String> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            x => Err(format!(
                "{}: option flag {x} at byte {} (expected 0 or 1)",
                self.what,
                self.at - 1
            )),
        }
    }
    fn routing(&mut self) -> Result<Option<RoutingTrace>, String> {
        if !self.flag()? {
            return Ok(None);
        }
        Ok(Some(RoutingTrace {
            layers: self.len()?,
            top_k: self.len()?,
            ids: self.u32s()?,
            weights: self.f32s()?,
        }))
    }
    fn probes(&mut self) -> Result<Option<LayerProbes>, String> {
        if !self.flag()? {
            return Ok(None);
        }
        Ok(Some(LayerProbes {
            layers: self.len()?,
            width: self.len()?,
            values: self.f32s()?,
        }))
    }
    fn end(&self) -> Result<(), String> {
        if self.at != self.b.len() {
            return Err(format!(
                "{}: {} trailing bytes",
                self.what,
                self.b.len() - self.at
            ));
        }
        Ok(())
    }
}

/// A decoded generate request.
struct GenerateRequest {
    prompts: Vec<Vec<u32>>,
    n: usize,
    cfg: SamplingConfig,
    eos: u32,
    seed: u64,
}

fn encode_generate(
    prompts: &[Vec<u32>],
    n: usize,
    cfg: &SamplingConfig,
    eos: u32,
    seed: u64,
) -> Vec<u8> {
    let mut e = Enc::default();
    e.len(n);
    e.u32(eos);
    e.u64(seed);
    e.f32(cfg.temperature);
    e.f32(cfg.top_p);
    e.len(cfg.max_new_tokens);
    e.len(prompts.len());
    for p in prompts {
        e.u32s(p);
    }
    e.0
}

fn decode_generate(b: &[u8]) -> Result<GenerateRequest, String> {
    let mut d = Dec::new(b, "generate request");
    let n = d.len()?;
    let eos = d.u32()?;
    let seed = d.u64()?;
    let cfg = SamplingConfig {
        temperature: d.f32()?,
        top_p: d.f32()?,
        max_new_tokens: d.len()?,
    };
    let np = d.count(8)?;
    let prompts = (0..np).map(|_| d.u32s()).collect::<Result<_, _>>()?;
    d.end()?;
    Ok(GenerateRequest {
        prompts,
        n,
        cfg,
        eos,
        seed,
    })
}

fn encode_samples(version: u64, samples: &[Sample]) -> Vec<u8> {
    let mut e = Enc::default();
    e.u64(version);
    e.len(samples.len());
    for s in samples {
        e.len(s.prompt_index);
        e.u32s(&s.prompt);
        e.u32s(&s.response);
        e.f32s(&s.logprobs);
        e.routing(s.routing.as_ref());
        e.probes(s.probes.as_ref());
    }
    e.0
}

fn decode_samples(b: &[u8]) -> Result<(u64, Vec<Sample>), String> {
    let mut d = Dec::new(b, "samples");
    let version = d.u64()?;
    let n = d.count(8)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(Sample {
            prompt_index: d.len()?,
            prompt: d.u32s()?,
            response: d.u32s()?,
            logprobs: d.f32s()?,
            routing: d.routing()?,
            probes: d.probes()?,
        });
    }
    d.end()?;
    Ok((version, out))
}

/// An owned [`TrainSeq`].
struct OwnedSeq {
    prompt: Vec<u32>,
    response: Vec<u32>,
    replay: Option<RoutingTrace>,
}

fn encode_score(batch: &[TrainSeq<'_>], temperature: f32) -> Vec<u8> {
    let mut e = Enc::default();
    e.f32(temperature);
    e.len(batch.len());
    for s in batch {
        e.u32s(s.prompt);
        e.u32s(s.response);
        e.routing(s.replay);
    }
    e.0
}

fn decode_score(b: &[u8]) -> Result<(f32, Vec<OwnedSeq>), String> {
    let mut d = Dec::new(b, "score request");
    let t = d.f32()?;
    let n = d.count(8)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(OwnedSeq {
            prompt: d.u32s()?,
            response: d.u32s()?,
            replay: d.routing()?,
        });
    }
    d.end()?;
    Ok((t, out))
}

fn encode_logprobs(version: u64, lps: &[Vec<f32>]) -> Vec<u8> {
    let mut e = Enc::default();
    e.u64(version);
    e.len(lps.len());
    for l in lps {
        e.f32s(l);
    }
    e.0
}

fn decode_logprobs(b: &[u8]) -> Result<(u64, Vec<Vec<f32>>), String> {
    let mut d = Dec::new(b, "logprobs");
    let version = d.u64()?;
    let n = d.count(8)?;
    let out = (0..n).map(|_| d.f32s()).collect::<Result<_, _>>()?;
    d.end()?;
    Ok((version, out))
}

// ---------------------------------------------------------------------------------------------
// Server.

/// Something that happened on the server, for its log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerEvent {
    /// A client connected.
    Connected {
        /// The client.
        peer: String,
    },
    /// A weight update was verified and applied.
    Applied {
        /// The sender.
        peer: String,
        /// What was applied.
        report: ApplyReport,
    },
    /// A complete update was refused; nothing changed.
    Refused {
        /// The sender.
        peer: String,
        /// The version still served.
        serving: u64,
        /// Why.
        error: String,
    },
    /// The connection broke in the middle of an update or a request; nothing changed.
    Dropped {
        /// The client.
        peer: String,
        /// The version still served.
        serving: u64,
        /// What was going on and the transport error.
        error: String,
    },
    /// A client closed its connection at a message boundary.
    Disconnected {
        /// The client.
        peer: String,
    },
    /// A client asked the server to stop.
    Shutdown {
        /// The client.
        peer: String,
    },
}

impl std::fmt::Display for ServerEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServerEvent::Connected { peer } => write!(f, "{peer}: connected"),
            ServerEvent::Applied { peer, report } => write!(
                f,
                "{peer}: applied weight version {} ({} bytes in {} buckets)",
                report.version, report.bytes, report.buckets
            ),
            ServerEvent::Refused {
                peer,
                serving,
                error,
            } => write!(
                f,
                "{peer}: refused a weight update, still serving v{serving}: {error}"
            ),
            ServerEvent::Dropped {
                peer,
                serving,
                error,
            } => write!(
                f,
                "{peer}: connection dropped ({error}); still serving v{serving}"
            ),
            ServerEvent::Disconnected { peer } => write!(f, "{peer}: disconnected"),
            ServerEvent::Shutdown { peer } => write!(f, "{peer}: shutdown requested"),
        }
    }
}

struct Shared<P> {
    engine: Mutex<RolloutEngine<P>>,
    contract_hash: String,
    recipe: String,
    model: String,
    stop: Arc<AtomicBool>,
}

impl<P: RolloutPolicy> Shared<P> {
    fn lock(&self) -> Result<MutexGuard<'_, RolloutEngine<P>>, String> {
        self.engine.lock().map_err(|_| {
            "the rollout engine is unusable after a panic in an earlier request".into()
        })
    }
    fn serving(&self) -> u64 {
        self.lock().map(|e| e.version).unwrap_or(0)
    }
}

enum Listener {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, p) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A handle that stops a running [`RolloutServer::serve`] (as a [`K_SHUTDOWN`] request does).
#[derive(Debug, Clone)]
pub struct StopHandle(Arc<AtomicBool>);

impl StopHandle {
    /// Ask the server to stop accepting connections and return from `serve`.
    pub fn stop(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// A rollout engine listening on an [`Endpoint`].
pub struct RolloutServer<P> {
    shared: Arc<Shared<P>>,
    listener: Listener,
    endpoint: Endpoint,
}

impl<P> std::fmt::Debug for RolloutServer<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RolloutServer({})", self.endpoint)
    }
}

fn bind_unix(path: &Path, ep: &Endpoint) -> Result<UnixListener, ServerError> {
    let io = |what: &str, e: std::io::Error| ServerError::Io {
        peer: ep.to_string(),
        what: what.into(),
        msg: e.to_string(),
    };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if !meta.file_type().is_socket() {
            return Err(io(
                "bind",
                std::io::Error::other("the path exists and is not a socket"),
            ));
        }
        if UnixStream::connect(path).is_ok() {
            return Err(io(
                "bind",
                std::io::Error::other("another server is listening there"),
            ));
        }
        // A socket file left behind by a server that was killed.
        std::fs::remove_file(path).map_err(|e| io("remove stale socket", e))?;
    }
    UnixListener::bind(path).map_err(|e| io("bind", e))
}

impl<P: RolloutPolicy + Send + 'static> RolloutServer<P> {
    /// Listen on `ep` (a TCP port 0 picks a free port; see [`RolloutServer::endpoint`]).
    /// `engine` is served as is: its version and contract hash are the server's. A stale Unix
    /// socket file (no server behind it) is replaced; the socket file is removed when the
    /// server stops.
    pub fn bind(
        ep: &Endpoint,
        engine: RolloutEngine<P>,
        recipe: &str,
        model: &str,
    ) -> Result<Self, ServerError> {
        let io = |what: &str, e: std::io::Error| ServerError::Io {
            peer: ep.to_string(),
            what: what.into(),
            msg: e.to_string(),
        };
        let (listener, endpoint) = match ep {
            Endpoint::Unix(p) => (
                Listener::Unix(bind_unix(p, ep)?, p.clone()),
                Endpoint::Unix(p.clone()),
            ),
            Endpoint::Tcp(a) => {
                let l = TcpListener::bind(a.as_str()).map_err(|e| io("bind", e))?;
                let local = l.local_addr().map_err(|e| io("local address", e))?;
                (Listener::Tcp(l), Endpoint::Tcp(local.to_string()))
            }
        };
        match &listener {
            Listener::Unix(l, _) => l.set_nonblocking(true),
            Listener::Tcp(l) => l.set_nonblocking(true),
        }
        .map_err(|e| io("set non-blocking", e))?;
        Ok(RolloutServer {
            shared: Arc::new(Shared {
                contract_hash: engine.contract_hash.clone(),
                engine: Mutex::new(engine),
                recipe: recipe.into(),
                model: model.into(),
                stop: Arc::new(AtomicBool::new(false)),
            }),
            listener,
            endpoint,
        })
    }

    /// The address clients connect to (with the port a TCP port 0 was given).
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// A handle that stops [`RolloutServer::serve`].
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle(self.shared.stop.clone())
    }

    /// Accept clients (one thread each) until a [`K_SHUTDOWN`] request or the stop handle;
    /// `on_event` sees every [`ServerEvent`] on the calling thread.
    pub fn serve(self, on_event: &mut dyn FnMut(&ServerEvent)) -> Result<(), ServerError> {
        let (tx, rx) = mpsc::channel::<ServerEvent>();
        let counter = AtomicU64::new(0);
        let drain = |on_event: &mut dyn FnMut(&ServerEvent)| {
            while let Ok(ev) = rx.try_recv() {
                on_event(&ev);
            }
        };
        while !self.shared.stop.load(Ordering::SeqCst) {
            let accepted = match &self.listener {
                Listener::Unix(l, _) => l.accept().map(|(s, _)| {
                    let n = counter.fetch_add(1, Ordering::Relaxed) + 1;
                    (Stream::Unix(s), format!("{} client {n}", self.endpoint))
                }),
                Listener::Tcp(l) => l
                    .accept()
                    .map(|(s, a)| (Stream::Tcp(s), format!("tcp:{a}"))),
            };
            match accepted {
                Ok((s, peer)) => {
                    let setup = match &s {
                        Stream::Unix(u) => u.set_nonblocking(false),
                        Stream::Tcp(t) => {
                            t.set_nonblocking(false).and_then(|_| t.set_nodelay(true))
                        }
                    };
                    if let Err(e) = setup {
                        let _ = tx.send(ServerEvent::Dropped {
                            peer,
                            serving: self.shared.serving(),
                            error: format!("socket setup: {e}"),
                        });
                        continue;
                    }
                    let _ = tx.send(ServerEvent::Connected { peer: peer.clone() });
                    let shared = self.shared.clone();
                    let tx = tx.clone();
                    std::thread::spawn(move || connection(s, peer, &shared, &tx));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    drain(on_event);
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(ServerError::Io {
                        peer: self.endpoint.to_string(),
                        what: "accept".into(),
                        msg: e.to_string(),
                    })
                }
            }
        }
        drain(on_event);
        Ok(())
    }
}

fn reply(s: &mut Stream, kind: u8, payload: &[u8]) -> Result<(), SyncError> {
    write_frame(s, kind, &[payload])?;
    s.flush()
        .map_err(|e| SyncError::Transport(format!("flush: {e}")))
}

/// Serve one client until it disconnects or asks for shutdown.
fn connection<P: RolloutPolicy>(
    mut s: Stream,
    peer: String,
    sh: &Shared<P>,
    tx: &mpsc::Sender<ServerEvent>,
) {
    let dropped = |error: String| ServerEvent::Dropped {
        peer: peer.clone(),
        serving: sh.serving(),
        error,
    };
    loop {
        let (kind, p) = match read_frame_opt(&mut s) {
            Ok(Some(f)) => f,
            Ok(None) => {
                let _ = tx.send(ServerEvent::Disconnected { peer: peer.clone() });
                return;
            }
            Err(e) => {
                let _ = tx.send(dropped(format!("between requests: {e}")));
                return;
            }
        };
        let answered = match kind {
            K_HEADER => match update(&mut s, &peer, sh, &p) {
                Ok(ev) => {
                    let _ = tx.send(ev);
                    Ok(())
                }
                Err(ev) => {
                    let _ = tx.send(ev);
                    return;
                }
            },
            K_INFO => match info(sh) {
                Ok(i) => reply(
                    &mut s,
                    K_INFO_REPLY,
                    &serde_json::to_vec(&i).expect("info serializes"),
                ),
                Err(e) => reply(&mut s, K_ERROR, e.as_bytes()),
            },
            K_GENERATE => match generate(sh, &p) {
                Ok(b) => reply(&mut s, K_SAMPLES, &b),
                Err(e) => reply(&mut s, K_ERROR, e.as_bytes()),
            },
            K_SCORE => match score(sh, &p) {
                Ok(b) => reply(&mut s, K_LOGPROBS, &b),
                Err(e) => reply(&mut s, K_ERROR, e.as_bytes()),
            },
            K_DIGEST => match sh.lock() {
                Ok(e) => {
                    let d = WeightsDigest {
                        version: e.version,
                        tensors: e.policy.weights().iter().map(TensorDigest::of).collect(),
                    };
                    drop(e);
                    reply(
                        &mut s,
                        K_DIGEST_REPLY,
                        &serde_json::to_vec(&d).expect("digest serializes"),
                    )
                }
                Err(e) => reply(&mut s, K_ERROR, e.as_bytes()),
            },
            K_FETCH => match sh.lock() {
                Ok(e) => {
                    let mut b = e.version.to_le_bytes().to_vec();
                    for t in e.policy.weights() {
                        serialize_tensor(&t, &mut b);
                    }
                    drop(e);
                    reply(&mut s, K_WEIGHTS, &b)
                }
                Err(e) => reply(&mut s, K_ERROR, e.as_bytes()),
            },
            K_SHUTDOWN => {
                sh.stop.store(true, Ordering::SeqCst);
                let _ = tx.send(ServerEvent::Shutdown { peer: peer.clone() });
                let _ = reply(&mut s, K_BYE, &[]);
                return;
            }
            other => {
                // Out of sync (or not a client of this protocol): say so and close.
                let msg = format!(
                    "expected a request frame (kinds 1, 5, 7, 9, 11, 13, 15), got kind {other}"
                );
                let _ = reply(&mut s, K_ERROR, msg.as_bytes());
                let _ = tx.send(dropped(msg));
                return;
            }
        };
        if let Err(e) = answered {
            let _ = tx.send(dropped(format!("answering kind {kind}: {e}")));
            return;
        }
    }
}

fn info<P: RolloutPolicy>(sh: &Shared<P>) -> Result<ServerInfo, String> {
    let e = sh.lock()?;
    let w = e.policy.weights();
    Ok(ServerInfo {
        protocol: PROTOCOL,
        version: e.version,
        contract_hash: sh.contract_hash.clone(),
        recipe: sh.recipe.clone(),
        model: sh.model.clone(),
        tensors: w.len(),
        weight_bytes: w.iter().map(|t| t.byte_len() as u64).sum(),
    })
}

fn generate<P: RolloutPolicy>(sh: &Shared<P>, p: &[u8]) -> Result<Vec<u8>, String> {
    let r = decode_generate(p)?;
    let mut e = sh.lock()?;
    let samples = e
        .policy
        .generate(&r.prompts, r.n, &r.cfg, r.eos, r.seed)
        .map_err(|e| format!("generate: {e}"))?;
    let v = e.version;
    drop(e);
    Ok(encode_samples(v, &samples))
}

fn score<P: RolloutPolicy>(sh: &Shared<P>, p: &[u8]) -> Result<Vec<u8>, String> {
    let (t, seqs) = decode_score(p)?;
    let batch: Vec<TrainSeq<'_>> = seqs
        .iter()
        .map(|s| TrainSeq {
            prompt: &s.prompt,
            response: &s.response,
            replay: s.replay.as_ref(),
        })
        .collect();
    let mut e = sh.lock()?;
    let lps = e
        .policy
        .score(&batch, t)
        .map_err(|e| format!("score: {e}"))?;
    let v = e.version;
    drop(e);
    Ok(encode_logprobs(v, &lps))
}

/// Receive the rest of an update whose header frame carried `header`: buckets are verified as
/// they arrive (outside the engine lock), the update is installed at its commit frame, and an
/// [`Ack`] answers it. `Err` means the connection is gone or out of sync (close it).
fn update<P: RolloutPolicy>(
    s: &mut Stream,
    peer: &str,
    sh: &Shared<P>,
    header: &[u8],
) -> Result<ServerEvent, ServerEvent> {
    let mut failed: Option<SyncError> = None;
    let mut asm = None;
    let mut announced = None;
    match serde_json::from_slice::<UpdateHeader>(header) {
        Ok(h) => {
            announced = Some(h.clone());
            match UpdateAssembler::begin(h, &sh.contract_hash) {
                Ok(a) => asm = Some(a),
                Err(e) => failed = Some(e),
            }
        }
        Err(e) => failed = Some(SyncError::Transport(format!("update header JSON: {e}"))),
    }
    let v = announced.as_ref().map_or(0, |h| h.version);
    let dropped = |error: String| ServerEvent::Dropped {
        peer: peer.into(),
        serving: sh.serving(),
        error,
    };
    // Read up to the commit frame whatever happens, so the stream stays in sync.
    loop {
        let (k, p) = read_frame(s).map_err(|e| {
            dropped(format!(
                "in the middle of weight update v{v}, before its commit frame: {e}; the partial update was discarded"
            ))
        })?;
        match k {
            K_BUCKET => {
                if let (None, Some(a)) = (&failed, asm.as_mut()) {
                    let r = if p.len() < 36 {
                        Err(SyncError::Bucket {
                            version: v,
                            index: u32::MAX,
                            msg: format!("bucket frame of {} bytes, expected at least 36", p.len()),
                        })
                    } else {
                        a.add(&Bucket {
                            index: u32::from_le_bytes(p[..4].try_into().expect("4 bytes")),
                            checksum: p[4..36].try_into().expect("32 bytes"),
                            payload: p[36..].to_vec(),
                        })
                    };
                    if let Err(e) = r {
                        failed = Some(e);
                        asm = None;
                    }
                }
            }
            K_COMMIT => {
                if failed.is_none() && p != v.to_le_bytes() {
                    failed = Some(SyncError::Transport(format!(
                        "commit frame does not name version v{v} of the header"
                    )));
                }
                break;
            }
            other => {
                let msg = format!(
                    "weight update v{v}: expected a bucket or commit frame, got kind {other}"
                );
                let ack = Ack {
                    version: sh.serving(),
                    error: Some(msg.clone()),
                };
                let _ = reply(s, K_ACK, &serde_json::to_vec(&ack).expect("ack serializes"));
                return Err(dropped(msg));
            }
        }
    }
    let result = match (failed, asm, announced) {
        (Some(e), _, _) => Err(e.to_string()),
        (None, Some(a), Some(h)) => {
            a.finish()
                .map_err(|e| e.to_string())
                .and_then(|(version, tensors)| {
                    let mut e = sh.lock()?;
                    e.install(version, &tensors).map_err(|e| e.to_string())?;
                    Ok(ApplyReport {
                        version,
                        bytes: h.bytes,
                        buckets: h.buckets,
                    })
                })
        }
        _ => unreachable!("no failure recorded implies a parsed header and an assembler"),
    };
    let serving = sh.serving();
    let ack = Ack {
        version: serving,
        error: result.as_ref().err().cloned(),
    };
    let sent = reply(s, K_ACK, &serde_json::to_vec(&ack).expect("ack serializes"));
    let ev = match result {
        Ok(report) => ServerEvent::Applied {
            peer: peer.into(),
            report,
        },
        Err(error) => ServerEvent::Refused {
            peer: peer.into(),
            serving,
            error,
        },
    };
    match sent {
        Ok(()) => Ok(ev),
        // The update was handled, but the client will not hear about it: log both.
        Err(e) => Err(dropped(format!(
            "{ev}; then the ack could not be sent: {e}"
        ))),
    }
}

// ---------------------------------------------------------------------------------------------
// Client.

/// A connection to a rollout server: one method per request.
#[derive(Debug)]
pub struct RolloutClient {
    endpoint: Endpoint,
    stream: Stream,
}

impl RolloutClient {
    /// Connect to the server at `ep`.
    pub fn connect(ep: &Endpoint) -> Result<Self, ServerError> {
        Ok(RolloutClient {
            endpoint: ep.clone(),
            stream: Stream::connect(ep)?,
        })
    }

    /// The server's address.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    fn peer(&self) -> String {
        self.endpoint.to_string()
    }

    fn request(
        &mut self,
        kind: u8,
        payload: &[u8],
        want: u8,
        what: &str,
    ) -> Result<Vec<u8>, ServerError> {
        let io = |e: SyncError| ServerError::Io {
            peer: self.endpoint.to_string(),
            what: what.into(),
            msg: e.to_string(),
        };
        write_frame(&mut self.stream, kind, &[payload]).map_err(io)?;
        self.stream
            .flush()
            .map_err(|e| io(SyncError::Transport(format!("flush: {e}"))))?;
        let (k, p) = read_frame(&mut self.stream).map_err(io)?;
        if k == K_ERROR {
            return Err(ServerError::Remote {
                peer: self.peer(),
                request: what.into(),
                msg: String::from_utf8_lossy(&p).into_owned(),
            });
        }
        if k != want {
            return Err(ServerError::Protocol {
                peer: self.peer(),
                msg: format!("{what}: expected a reply frame of kind {want}, got kind {k}"),
            });
        }
        Ok(p)
    }

    fn protocol(&self, msg: String) -> ServerError {
        ServerError::Protocol {
            peer: self.peer(),
            msg,
        }
    }

    /// The server's version, contract, recipe and model.
    pub fn info(&mut self) -> Result<ServerInfo, ServerError> {
        let p = self.request(K_INFO, &[], K_INFO_REPLY, "info")?;
        serde_json::from_slice(&p).map_err(|e| self.protocol(format!("info reply: {e}")))
    }

    /// Generate on the server; returns the version that sampled and the samples.
    pub fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        n: usize,
        cfg: &SamplingConfig,
        eos: u32,
        seed: u64,
    ) -> Result<(u64, Vec<Sample>), ServerError> {
        let req = encode_generate(prompts, n, cfg, eos, seed);
        let p = self.request(K_GENERATE, &req, K_SAMPLES, "generate")?;
        let (v, samples) = decode_samples(&p).map_err(|m| self.protocol(m))?;
        if samples.len() != prompts.len() * n {
            return Err(self.protocol(format!(
                "generate: expected {} samples ({} prompts × {n}), got {}",
                prompts.len() * n,
                prompts.len(),
                samples.len()
            )));
        }
        Ok((v, samples))
    }

    /// Score on the server (bitwise mode); returns the version and one logprob list per
    /// sequence.
    pub fn score(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<(u64, Vec<Vec<f32>>), ServerError> {
        let req = encode_score(batch, temperature);
        let p = self.request(K_SCORE, &req, K_LOGPROBS, "score")?;
        let (v, lps) = decode_logprobs(&p).map_err(|m| self.protocol(m))?;
        if lps.len() != batch.len() {
            return Err(self.protocol(format!(
                "score: expected {} logprob lists, got {}",
                batch.len(),
                lps.len()
            )));
        }
        Ok((v, lps))
    }

    /// SHA-256 digests of the weights the server holds.
    pub fn digest(&mut self) -> Result<WeightsDigest, ServerError> {
        let p = self.request(K_DIGEST, &[], K_DIGEST_REPLY, "weight digest")?;
        serde_json::from_slice(&p).map_err(|e| self.protocol(format!("digest reply: {e}")))
    }

    /// The weights the server holds, byte for byte, and their version.
    pub fn fetch(&mut self) -> Result<(u64, Vec<WireTensor>), ServerError> {
        let p = self.request(K_FETCH, &[], K_WEIGHTS, "weight fetch")?;
        if p.len() < 8 {
            return Err(self.protocol(format!(
                "weights reply of {} bytes, expected at least 8",
                p.len()
            )));
        }
        let v = u64::from_le_bytes(p[..8].try_into().expect("8 bytes"));
        let ts = deserialize_tensors(&p[8..])
            .ok_or_else(|| self.protocol("weights reply: malformed tensor record".into()))?;
        Ok((v, ts))
    }

    /// Send a complete weight update and wait for the server's [`Ack`]. A refused update is
    /// [`ServerError::Refused`] (the server serves its previous version).
    pub fn update(&mut self, u: &WeightUpdate) -> Result<Ack, ServerError> {
        match write_update(&mut self.stream, u) {
            Ok(a) => Ok(a),
            Err(SyncError::Rejected(msg)) => Err(ServerError::Refused {
                peer: self.peer(),
                version: u.header.version,
                serving: parse_serving(&msg).unwrap_or(0),
                msg,
            }),
            Err(e) => Err(ServerError::Io {
                peer: self.peer(),
                what: format!("weight update v{}", u.header.version),
                msg: e.to_string(),
            }),
        }
    }

    /// Ask the server to stop; it finishes the requests in flight and stops accepting.
    pub fn shutdown(&mut self) -> Result<(), ServerError> {
        self.request(K_SHUTDOWN, &[], K_BYE, "shutdown").map(|_| ())
    }
}

/// `write_update` reports a refusal as the server's message only; the served version is
/// carried in the [`Ack`], which the refusal path does not return. The messages of
/// [`SyncError::Stale`] name it; other refusals leave it unknown.
fn parse_serving(msg: &str) -> Option<u64> {
    msg.split("served version v").nth(1).and_then(|r| {
        r.chars()
            .take_while(|c| c.is_ascii_digit())
            .collect::<String>()
            .parse()
            .ok()
    })
}

/// A [`RolloutPolicy`] whose weights and sampling live in a rollout server.
///
/// `load_weights_versioned` (called by the rollout engine of [`crate::runner::RlRun`]) sends
/// a full, versioned, checksummed update and waits for the server's [`Ack`]; a refused or
/// broken update is an error and leaves the server on its previous version.
#[derive(Debug)]
pub struct RemoteRollout {
    client: Mutex<RolloutClient>,
    info: ServerInfo,
    contract_hash: String,
    /// Bucket size of the updates it sends (bytes).
    pub bucket_bytes: usize,
    version: u64,
}

impl RemoteRollout {
    /// Connect to `ep` and check that the server uses the quantizer contract `contract_hash`.
    pub fn connect(ep: &Endpoint, contract_hash: &str) -> Result<Self, ServerError> {
        let mut c = RolloutClient::connect(ep)?;
        let info = c.info()?;
        if info.protocol != PROTOCOL {
            return Err(ServerError::Protocol {
                peer: ep.to_string(),
                msg: format!(
                    "server speaks protocol {}, expected {PROTOCOL}",
                    info.protocol
                ),
            });
        }
        if info.contract_hash != contract_hash {
            return Err(ServerError::Contract {
                peer: ep.to_string(),
                server: info.contract_hash,
                ours: contract_hash.into(),
            });
        }
        Ok(RemoteRollout {
            version: info.version,
            client: Mutex::new(c),
            info,
            contract_hash: contract_hash.into(),
            bucket_bytes: 1 << 20,
        })
    }

    /// What the server said when this client connected.
    pub fn info(&self) -> &ServerInfo {
        &self.info
    }

    /// The last version the server confirmed.
    pub fn version(&self) -> u64 {
        self.version
    }

    fn client(&self) -> MutexGuard<'_, RolloutClient> {
        // A panic while holding this lock can only come from a caller's panic mid-request;
        // the stream may then be out of sync, which the next request reports.
        self.client
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The server's held weights (see [`RolloutClient::fetch`]).
    pub fn fetch_weights(&self) -> Result<(u64, Vec<WireTensor>), ServerError> {
        self.client().fetch()
    }

    /// Ask the server to stop.
    pub fn shutdown_server(&self) -> Result<(), ServerError> {
        self.client().shutdown()
    }
}

fn backend(e: ServerError) -> PolicyError {
    PolicyError::Backend(e.to_string())
}

impl RolloutPolicy for RemoteRollout {
    fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        n: usize,
        cfg: &SamplingConfig,
        eos: u32,
        seed: u64,
    ) -> Result<Vec<Sample>, PolicyError> {
        let (_, s) = self
            .client()
            .generate(prompts, n, cfg, eos, seed)
            .map_err(backend)?;
        Ok(s)
    }

    /// Sends the tensors as version "last confirmed + 1".
    fn load_weights(&mut self, tensors: &[WireTensor]) -> Result<(), PolicyError> {
        self.load_weights_versioned(self.version + 1, tensors)
    }

    fn load_weights_versioned(
        &mut self,
        version: u64,
        tensors: &[WireTensor],
    ) -> Result<(), PolicyError> {
        let u = WeightUpdate::build(version, &self.contract_hash, tensors, self.bucket_bytes);
        let ack = self
            .client()
            .update(&u)
            .map_err(|e| PolicyError::Update(e.to_string()))?;
        if ack.version != version {
            return Err(PolicyError::Update(format!(
                "rollout server {}: acknowledged v{} for update v{version}",
                self.info.model, ack.version
            )));
        }
        self.version = version;
        Ok(())
    }

    /// The server's held weights; empty when the server cannot be reached (use
    /// [`RemoteRollout::fetch_weights`] to see the error).
    fn weights(&self) -> Vec<WireTensor> {
        self.fetch_weights().map(|(_, w)| w).unwrap_or_default()
    }

    fn check_weights(&self, expected: &[WireTensor]) -> Result<(), SyncError> {
        let mut c = self.client();
        let d = c
            .digest()
            .map_err(|e| SyncError::Transport(e.to_string()))?;
        check_digests(&c.peer(), &d, expected)
    }

    fn score(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<Vec<Vec<f32>>, PolicyError> {
        let (_, l) = self.client().score(batch, temperature).map_err(backend)?;
        Ok(l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::TrainPolicy;
    use crate::sync;
    use crate::tabular::{TabularShape, TabularTrainer};

    fn trainer(seed: f32, format: Format) -> TabularTrainer {
        let mut t = TabularTrainer::new(
            TabularShape {
                buckets: 8,
                max_len: 4,
                vocab: 64,
            },
            format,
        );
        for p in t.params() {
            for (i, v) in p.value.iter_mut().enumerate() {
                *v = (i as f32 * 0.37 + seed).sin() * 3.0;
            }
        }
        t
    }

    /// Start a server for `policy` on `ep` in a thread; returns its address, the receiving end
    /// of its event log and the thread.
    fn start<P: RolloutPolicy + Send + 'static>(
        ep: &Endpoint,
        policy: P,
        contract: &str,
    ) -> (
        Endpoint,
        mpsc::Receiver<ServerEvent>,
        std::thread::JoinHandle<()>,
    ) {
        let srv =
            RolloutServer::bind(ep, RolloutEngine::new(policy, 0, contract), "bf16", "t").unwrap();
        let at = srv.endpoint().clone();
        let (tx, rx) = mpsc::channel();
        let h = std::thread::spawn(move || {
            srv.serve(&mut |e| {
                let _ = tx.send(e.clone());
            })
            .unwrap();
        });
        (at, rx, h)
    }

    /// Events up to (and including) the first that `stop` accepts; waits at most 10 s.
    fn until(
        rx: &mpsc::Receiver<ServerEvent>,
        stop: impl Fn(&ServerEvent) -> bool,
    ) -> Vec<ServerEvent> {
        let mut out = Vec::new();
        loop {
            let e = rx
                .recv_timeout(Duration::from_secs(10))
                .unwrap_or_else(|_| panic!("no matching server event; saw {out:?}"));
            let done = stop(&e);
            out.push(e);
            if done {
                return out;
            }
        }
    }

    #[test]
    fn endpoints_parse_and_bad_ones_are_named() {
        assert_eq!(
            "unix:/tmp/x.sock".parse::<Endpoint>().unwrap(),
            Endpoint::Unix("/tmp/x.sock".into())
        );
        assert_eq!(
            "tcp:127.0.0.1:7000"
                .parse::<Endpoint>()
                .unwrap()
                .to_string(),
            "tcp:127.0.0.1:7000"
        );
        for bad in [
            "unix:",
            "tcp:7000",
            "tcp:host:notaport",
            "http://x",
            "spawn",
        ] {
            let e = bad.parse::<Endpoint>().unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("unix:PATH"), "{e}");
        }
    }

    #[test]
    fn payloads_round_trip_bit_exactly() {
        let samples = vec![
            Sample {
                prompt_index: 3,
                prompt: vec![1, 2, 3],
                response: vec![u32::MAX, 0],
                logprobs: vec![-0.0, f32::NEG_INFINITY],
                routing: Some(RoutingTrace {
                    layers: 2,
                    top_k: 1,
                    ids: vec![4, 5],
                    weights: vec![f32::from_bits(0x3f80_0001), f32::MIN_POSITIVE / 2.0],
                }),
                probes: Some(LayerProbes {
                    layers: 1,
                    width: 1,
                    values: vec![f32::NAN],
                }),
            },
            Sample {
                prompt_index: 0,
                prompt: vec![],
                response: vec![],
                logprobs: vec![],
                routing: None,
                probes: None,
            },
        ];
        let b = encode_samples(7, &samples);
        let (v, back) = decode_samples(&b).unwrap();
        assert_eq!(v, 7);
        let bits = |s: &[Sample]| {
            s.iter()
                .map(|x| {
                    (
                        x.logprobs.iter().map(|f| f.to_bits()).collect::<Vec<_>>(),
                        x.routing
                            .as_ref()
                            .map(|r| r.weights.iter().map(|f| f.to_bits()).collect::<Vec<_>>()),
                        x.probes
                            .as_ref()
                            .map(|r| r.values.iter().map(|f| f.to_bits()).collect::<Vec<_>>()),
                        (x.prompt_index, x.prompt.clone(), x.response.clone()),
                    )
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&back), bits(&samples));
        // Every truncation of the payload is an error naming the payload, never a panic.
        for cut in 0..b.len() {
            let e = decode_samples(&b[..cut]).unwrap_err();
            assert!(e.starts_with("samples:"), "{e}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(decode_samples(&long).unwrap_err().contains("trailing"));

        let cfg = SamplingConfig {
            temperature: f32::from_bits(0x3f33_3334),
            top_p: 0.9,
            max_new_tokens: 5,
        };
        let g = decode_generate(&encode_generate(&[vec![1], vec![]], 3, &cfg, 9, 42)).unwrap();
        assert_eq!(
            (g.prompts, g.n, g.eos, g.seed, g.cfg.temperature.to_bits()),
            (vec![vec![1], vec![]], 3, 9, 42, 0x3f33_3334)
        );
        assert_eq!(g.cfg, cfg);
    }

    #[test]
    fn remote_policy_matches_the_local_policy_and_shuts_down() {
        let dir = tempfile::tempdir().unwrap();
        for ep in [
            Endpoint::Unix(dir.path().join("r.sock")),
            Endpoint::Tcp("127.0.0.1:0".into()),
        ] {
            let t0 = trainer(0.0, Format::Mxfp8);
            let mut local = t0.rollout().unwrap();
            let (at, rx, h) = start(&ep, t0.rollout().unwrap(), "h");
            let mut remote = RemoteRollout::connect(&at, "h").unwrap();
            assert_eq!((remote.info().version, remote.info().tensors), (0, 1));
            let prompts = vec![vec![1, 2], vec![3]];
            let cfg = SamplingConfig {
                temperature: 0.7,
                top_p: 0.9,
                max_new_tokens: 4,
            };
            let a = local.generate(&prompts, 3, &cfg, 0, 11).unwrap();
            let b = remote.generate(&prompts, 3, &cfg, 0, 11).unwrap();
            assert_eq!(a, b);

            // A versioned update through the remote equals loading locally.
            let ex = trainer(1.0, Format::Mxfp8).export_weights().unwrap();
            remote.load_weights_versioned(4, &ex).unwrap();
            local.load_weights(&ex).unwrap();
            assert_eq!(remote.version(), 4);
            remote.check_weights(&ex).unwrap();
            sync::check_equal(&remote.weights(), &ex).unwrap();
            let seqs: Vec<TrainSeq<'_>> = a
                .iter()
                .map(|s| TrainSeq {
                    prompt: &s.prompt,
                    response: &s.response,
                    replay: None,
                })
                .collect();
            let la = local.score(&seqs, 0.7).unwrap();
            let lb = remote.score(&seqs, 0.7).unwrap();
            assert_eq!(
                la.concat().iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                lb.concat().iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
            // The digest check sees a single flipped data byte and names the tensor.
            let mut off = ex.clone();
            off[0].data[5] ^= 1;
            let e = remote.check_weights(&off).unwrap_err().to_string();
            assert!(
                e.contains("table") && e.contains("data bytes differ"),
                "{e}"
            );
            // An unversioned load goes to "last confirmed + 1".
            remote.load_weights(&off).unwrap();
            assert_eq!(remote.version(), 5);
            remote.check_weights(&off).unwrap();

            remote.shutdown_server().unwrap();
            h.join().unwrap();
            let evs: Vec<ServerEvent> = rx.try_iter().collect();
            let applied: Vec<u64> = evs
                .iter()
                .filter_map(|e| match e {
                    ServerEvent::Applied { report, .. } => Some(report.version),
                    _ => None,
                })
                .collect();
            assert_eq!(applied, [4, 5]);
            assert!(matches!(evs.last(), Some(ServerEvent::Shutdown { .. })));
            if let Endpoint::Unix(p) = &at {
                assert!(!p.exists(), "socket file left behind");
            }
        }
    }

    #[test]
    fn refused_and_dropped_updates_change_nothing_and_the_connection_survives_a_refusal() {
        let dir = tempfile::tempdir().unwrap();
        let ep = Endpoint::Unix(dir.path().join("u.sock"));
        let t0 = trainer(0.0, Format::Nvfp4);
        let before = t0.export_weights().unwrap();
        let (at, rx, h) = start(&ep, t0.rollout().unwrap(), "contract-a");
        let ex = trainer(2.0, Format::Nvfp4).export_weights().unwrap();

        // Client-side contract check at connect.
        let e = RemoteRollout::connect(&at, "contract-b").unwrap_err();
        assert!(matches!(e, ServerError::Contract { .. }), "{e}");

        let mut c = RolloutClient::connect(&at).unwrap();
        // Server-side contract check: refused, the same connection stays usable.
        let e = c
            .update(&WeightUpdate::build(1, "contract-b", &ex, 64))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("contract-b") && e.contains("contract-a") && e.contains("refused"),
            "{e}"
        );
        // A corrupt bucket: refused after the commit, connection still usable.
        // (The tabular policy has one tensor, so every update here is one bucket; the
        // multi-bucket case runs across processes in mxrl-cli's tests.)
        let mut bad = WeightUpdate::build(1, "contract-a", &ex, 64);
        bad.buckets[0].payload[3] ^= 1;
        let e = c.update(&bad).unwrap_err().to_string();
        assert!(e.contains("bucket 0") && e.contains("SHA-256"), "{e}");
        let (v, w) = c.fetch().unwrap();
        assert_eq!(v, 0);
        sync::check_equal(&w, &before).unwrap();

        // A connection that dies after the header and half of the bucket frame.
        let u = WeightUpdate::build(1, "contract-a", &ex, 64);
        let Endpoint::Unix(p) = &at else {
            unreachable!()
        };
        let mut raw = UnixStream::connect(p).unwrap();
        let hj = serde_json::to_vec(&u.header).unwrap();
        write_frame(&mut raw, K_HEADER, &[&hj]).unwrap();
        let mut frame = Vec::new();
        let b0 = &u.buckets[0];
        write_frame(
            &mut frame,
            K_BUCKET,
            &[&b0.index.to_le_bytes(), &b0.checksum, &b0.payload],
        )
        .unwrap();
        raw.write_all(&frame[..frame.len() / 2]).unwrap();
        drop(raw);
        let evs = until(&rx, |e| matches!(e, ServerEvent::Dropped { .. }));
        let ServerEvent::Dropped { error, serving, .. } = evs.last().unwrap() else {
            unreachable!()
        };
        assert_eq!(*serving, 0);
        assert!(error.contains("v1, before its commit frame"), "{error}");
        let (v, w) = c.fetch().unwrap();
        assert_eq!(v, 0);
        sync::check_equal(&w, &before).unwrap();

        // The complete update is accepted afterwards.
        assert_eq!(c.update(&u).unwrap().version, 1);
        let (v, w) = c.fetch().unwrap();
        assert_eq!(v, 1);
        sync::check_equal(&w, &ex).unwrap();
        // Stale versions are refused and name the served version.
        let e = c.update(&u).unwrap_err();
        assert!(
            matches!(
                e,
                ServerError::Refused {
                    version: 1,
                    serving: 1,
                    ..
                }
            ),
            "{e}"
        );
        c.shutdown().unwrap();
        h.join().unwrap();
        let refused = evs
            .iter()
            .chain(rx.try_iter().collect::<Vec<_>>().iter())
            .filter(|e| matches!(e, ServerEvent::Refused { .. }))
            .count();
        assert_eq!(refused, 3);
    }
}
