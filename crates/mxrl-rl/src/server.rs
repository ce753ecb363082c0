//! The rollout engine in its own process: a gRPC service (`proto/rollout.proto`, served with
//! tonic) for any [`RolloutPolicy`] over a Unix socket or TCP, and [`RemoteRollout`], a client
//! that is itself a [`RolloutPolicy`], so the RL loop ([`crate::runner::RlRun`]) drives a
//! rollout engine in another process — or one written against the same `.proto` in another
//! language — without knowing it.
//!
//! # Design
//!
//! - **The engine runs on its own thread** and owns the policy; the async runtime only moves
//!   requests. Generate, score, fetch and install are jobs sent to that thread, each run under
//!   `catch_unwind`: a panic is answered as `ENGINE_ERROR` and the engine keeps serving. `Info`
//!   and health read a snapshot the engine thread refreshes after every applied update, so a
//!   long generation never blocks them; `Digest` reads the digest kept in it, computed at
//!   start and, after an update, by the engine thread on the first `Digest` call (an update
//!   never pays for a digest nobody asks for).
//! - **Limits are checked before anything is allocated or queued** ([`Limits`]): each of the
//!   three services has its own message size limit (enforced by tonic from the length prefix,
//!   before buffering; its refusal is re-typed as `LIMIT_EXCEEDED` by `TypedOversize`); a
//!   weight update's header is bounded by the model's tensor count and weight bytes, and its
//!   buckets may not exceed what the header announced; generate and score requests are bounded
//!   in sequences, lengths (by default the model's `max_position_embeddings`) and token ids,
//!   and routing traces must fit the model exactly. Every refusal is a gRPC status plus a typed
//!   [`pb::Refusal`] in the binary trailer `mxrl-refusal-bin` (reason, served version, the
//!   limit), and the connection stays usable.
//! - **Authentication**: on TCP every call must carry `authorization: Bearer <token>` (compared
//!   in constant time; the server refuses to start on TCP without a token). TCP off loopback
//!   is served and used only with TLS (rustls through tonic: [`ServerTls`] on the server,
//!   [`ClientTls`], the CA to trust, on the client); on loopback TLS is optional. A Unix socket
//!   is created owner-only (0600) and needs no token.
//! - **Connections** are capped (`max_connections`; further peers wait in the listen backlog),
//!   capped in concurrent calls each, and closed after `idle_timeout` without a byte from the
//!   peer (the Rust and Python clients send HTTP/2 keep-alive pings). An `accept` error
//!   (EMFILE, ...) is logged and retried, never fatal.
//! - **Weight updates keep the in-process semantics** of [`crate::sync`]: the contract hash,
//!   SHA-256 per bucket, versions only forward, atomic apply at an explicit commit. A stream
//!   that ends before its commit, or any refusal, changes nothing. Each bucket is verified and
//!   decoded on the blocking pool while the next one arrives; [`RemoteRollout`] sends the
//!   buckets its caller built (encoded and hashed once, payloads shared, not copied).

use crate::policy::{
    LayerProbes, PolicyError, RolloutPolicy, RoutingTrace, Sample, SamplingConfig, TrainSeq,
    WireTensor,
};
use crate::proto as pb;
use crate::sync::{
    format_from_proto, format_to_proto, sha256, verify_bucket, Bucket, RolloutEngine, SyncError,
    UpdateAssembler, UpdateHeader, WeightUpdate,
};
use mxrl_formats::Format;
use pb::refusal::Reason;
use prost::Message;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{mpsc, Arc, Mutex, MutexGuard, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{oneshot, watch, OwnedSemaphorePermit, Semaphore};
use tonic::metadata::{Ascii, MetadataMap, MetadataValue};
use tonic::{Code, Request, Response, Status};

/// Protocol revision reported in `InfoReply.protocol` (the revision of `proto/rollout.proto`).
pub const PROTOCOL: u32 = 3;

/// Errors of the rollout server and its client. Every message names the peer.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// An address that is neither `unix:PATH` nor `tcp:HOST:PORT`.
    #[error("rollout address `{0}`: expected unix:PATH or tcp:HOST:PORT")]
    Address(String),
    /// A configuration the server or client refuses (no token on TCP, a token file readable
    /// by others, a non-loopback address).
    #[error("rollout server {peer}: {msg}")]
    Config {
        /// The address.
        peer: String,
        /// What is wrong and how to fix it.
        msg: String,
    },
    /// A socket or runtime operation failed.
    #[error("rollout server {peer}: {what}: {msg}")]
    Io {
        /// The peer or listening address.
        peer: String,
        /// What was being done.
        what: String,
        /// The error.
        msg: String,
    },
    /// The peer answered something the protocol does not allow.
    #[error("rollout server {peer}: {msg}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What was expected and what arrived.
        msg: String,
    },
    /// A call failed: the gRPC status and, when the server refused it, the typed refusal.
    #[error("rollout server {peer}: {request} failed ({code:?}{}): {msg}",
        refusal.as_ref().map(|r| format!(", {:?}, serving v{}", r.reason(), r.serving_version)).unwrap_or_default())]
    Remote {
        /// The server.
        peer: String,
        /// The call.
        request: String,
        /// gRPC status code.
        code: Code,
        /// The server's (or the transport's) message.
        msg: String,
        /// The typed refusal of the `mxrl-refusal-bin` trailer, when the server sent one.
        refusal: Option<Box<pb::Refusal>>,
    },
    /// The server refused a weight update; it still serves `serving`.
    #[error(
        "rollout server {peer} refused weight update v{version} (still serving v{serving}, {reason:?}): {msg}"
    )]
    Refused {
        /// The server.
        peer: String,
        /// Version of the refused update.
        version: u64,
        /// Version the server serves.
        serving: u64,
        /// Why, as a type.
        reason: Reason,
        /// The server's message.
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

impl ServerError {
    /// The typed refusal of a failed call, if the server sent one.
    pub fn refusal(&self) -> Option<Reason> {
        match self {
            ServerError::Remote { refusal, .. } => refusal.as_ref().map(|r| r.reason()),
            ServerError::Refused { reason, .. } => Some(*reason),
            _ => None,
        }
    }
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

/// Resolve a TCP address `HOST:PORT` to its socket addresses (at least one).
fn resolve(ep: &Endpoint, addr: &str) -> Result<Vec<std::net::SocketAddr>, ServerError> {
    use std::net::ToSocketAddrs;
    let addrs: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| ServerError::Io {
            peer: ep.to_string(),
            what: "resolve".into(),
            msg: e.to_string(),
        })?
        .collect();
    if addrs.is_empty() {
        return Err(ServerError::Io {
            peer: ep.to_string(),
            what: "resolve".into(),
            msg: "no address".into(),
        });
    }
    Ok(addrs)
}

/// Whether every address is a loopback address (127.0.0.0/8, ::1): traffic to it never
/// leaves the machine, so a token may travel without TLS. Anything else — a wildcard
/// (0.0.0.0, ::), an interface address, a mapped address — counts as a network.
fn all_loopback(addrs: &[std::net::SocketAddr]) -> bool {
    !addrs.is_empty() && addrs.iter().all(|a| a.ip().is_loopback())
}

/// The host part of a TCP address `HOST:PORT` (brackets of an IPv6 literal removed): the name
/// a client checks the server's certificate against.
fn tcp_host(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

// ---------------------------------------------------------------------------------------------
// Token.

/// The shared secret of a TCP rollout server (`--token-file`). Its `Debug` form hides it.
#[derive(Clone)]
pub struct Token(String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<hidden>)")
    }
}

/// Fewest bytes a token may have.
pub const MIN_TOKEN_BYTES: usize = 16;

impl Token {
    /// A token from its text (surrounding whitespace removed): at least [`MIN_TOKEN_BYTES`]
    /// visible ASCII characters.
    pub fn new(text: &str) -> Result<Token, String> {
        let t = text.trim();
        if t.len() < MIN_TOKEN_BYTES {
            return Err(format!(
                "the token has {} characters, at least {MIN_TOKEN_BYTES} are required",
                t.len()
            ));
        }
        if !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("the token must be visible ASCII characters only".into());
        }
        Ok(Token(t.to_string()))
    }

    /// Read a token file: owner-only permissions (no group/other bits) and the rules of
    /// [`Token::new`]; errors name the file.
    pub fn from_file(path: &Path) -> Result<Token, ServerError> {
        let text = read_secret(path, "token file", "the token")?;
        let text = String::from_utf8(text).map_err(|_| ServerError::Config {
            peer: format!("token file {}", path.display()),
            msg: "not UTF-8 text".into(),
        })?;
        Token::new(&text).map_err(|msg| ServerError::Config {
            peer: format!("token file {}", path.display()),
            msg,
        })
    }

    /// Whether `presented` is this token; constant time in the token's content (both sides
    /// are hashed first, so lengths do not leak either).
    pub fn matches(&self, presented: &[u8]) -> bool {
        use subtle::ConstantTimeEq;
        sha256(self.0.as_bytes()).ct_eq(&sha256(presented)).into()
    }

    fn header(&self) -> MetadataValue<Ascii> {
        format!("Bearer {}", self.0)
            .parse()
            .expect("a visible-ASCII token is a valid header value")
    }
}

/// Largest token, certificate or key file read (bytes); real ones are a few KiB.
const MAX_SECRET_FILE_BYTES: u64 = 1 << 20;

/// Read a small file (`what` names it in errors), at most [`MAX_SECRET_FILE_BYTES`].
fn read_small(path: &Path, what: &str) -> Result<Vec<u8>, ServerError> {
    use std::io::Read;
    let err = |msg: String| ServerError::Config {
        peer: format!("{what} {}", path.display()),
        msg,
    };
    let f = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
    let mut buf = Vec::new();
    f.take(MAX_SECRET_FILE_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(|e| err(e.to_string()))?;
    if buf.len() as u64 > MAX_SECRET_FILE_BYTES {
        return Err(err(format!("larger than {MAX_SECRET_FILE_BYTES} bytes")));
    }
    Ok(buf)
}

/// Read a file holding a secret (`secret` says which): it must be readable by its owner only
/// (no group/other permission bits).
fn read_secret(path: &Path, what: &str, secret: &str) -> Result<Vec<u8>, ServerError> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(|e| ServerError::Config {
        peer: format!("{what} {}", path.display()),
        msg: e.to_string(),
    })?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(ServerError::Config {
            peer: format!("{what} {}", path.display()),
            msg: format!("mode {mode:o} lets other users read {secret}; run chmod 600 on it"),
        });
    }
    read_small(path, what)
}

// ---------------------------------------------------------------------------------------------
// TLS.

/// Longest a TLS handshake may take, on either side.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The PEM certificates of `pem` (from `what` at `path`): at least one, each well-formed.
fn pem_certificates(pem: &[u8], what: &str, path: &Path) -> Result<usize, ServerError> {
    use rustls_pki_types::pem::PemObject;
    let err = |msg: String| ServerError::Config {
        peer: format!("{what} {}", path.display()),
        msg,
    };
    let certs = rustls_pki_types::CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(err(
            "holds no certificate (expected PEM blocks `-----BEGIN CERTIFICATE-----`)".into(),
        ));
    }
    Ok(certs.len())
}

/// The server side of TLS (`mxrl rollout-server --tls-cert CERT.pem --tls-key KEY.pem`): the
/// server's certificate chain (its own certificate first) and private key, both PEM. Loading
/// checks that the chain parses, that the key file is readable by its owner only, and that
/// the key belongs to the certificate (rustls builds its configuration from them), so a bad
/// file stops the server before it listens, naming the file.
#[derive(Clone)]
pub struct ServerTls {
    config: tonic::transport::ServerTlsConfig,
    cert: PathBuf,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ServerTls({})", self.cert.display())
    }
}

impl ServerTls {
    /// Load the certificate chain `cert` and the private key `key` (PKCS#8, PKCS#1 or SEC1).
    pub fn from_files(cert: &Path, key: &Path) -> Result<ServerTls, ServerError> {
        use rustls_pki_types::pem::PemObject;
        let cert_pem = read_small(cert, "TLS certificate")?;
        pem_certificates(&cert_pem, "TLS certificate", cert)?;
        let key_pem = read_secret(key, "TLS key", "the private key")?;
        rustls_pki_types::PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
            ServerError::Config {
                peer: format!("TLS key {}", key.display()),
                msg: format!(
                    "holds no private key (expected a PEM PKCS#8, PKCS#1 or SEC1 key): {e}"
                ),
            }
        })?;
        let config = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(cert_pem, key_pem))
            .timeout(TLS_HANDSHAKE_TIMEOUT);
        // Build rustls' configuration once now: a key that does not belong to the
        // certificate is refused here rather than at the first handshake.
        tonic::transport::Server::builder()
            .tls_config(config.clone())
            .map_err(|e| ServerError::Config {
                peer: format!(
                    "TLS certificate {} and key {}",
                    cert.display(),
                    key.display()
                ),
                msg: format!("not usable together: {}", transport_msg(&e)),
            })?;
        Ok(ServerTls {
            config,
            cert: cert.to_path_buf(),
        })
    }
}

/// The client side of TLS (`--tls-ca CA.pem`): the certificate(s) of the authority that signed
/// the server's certificate, trusted as the only roots. The server's certificate must name the
/// host of the address connected to (a DNS name or an IP address), or the name given to
/// [`ClientTls::with_server_name`].
#[derive(Clone)]
pub struct ClientTls {
    ca: tonic::transport::Certificate,
    path: PathBuf,
    server_name: Option<String>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClientTls({})", self.path.display())
    }
}

impl ClientTls {
    /// Trust the PEM certificate(s) of `ca` (at least one).
    pub fn from_file(ca: &Path) -> Result<ClientTls, ServerError> {
        let pem = read_small(ca, "TLS CA")?;
        pem_certificates(&pem, "TLS CA", ca)?;
        Ok(ClientTls {
            ca: tonic::transport::Certificate::from_pem(pem),
            path: ca.to_path_buf(),
            server_name: None,
        })
    }

    /// Check the server's certificate against `name` instead of the host connected to (e.g.
    /// through an SSH tunnel to 127.0.0.1 of a server whose certificate names its host).
    pub fn with_server_name(mut self, name: &str) -> ClientTls {
        self.server_name = Some(name.to_string());
        self
    }

    fn config(&self, host: &str) -> tonic::transport::ClientTlsConfig {
        tonic::transport::ClientTlsConfig::new()
            .ca_certificate(self.ca.clone())
            .domain_name(self.server_name.as_deref().unwrap_or(host))
            .timeout(TLS_HANDSHAKE_TIMEOUT)
    }
}

// ---------------------------------------------------------------------------------------------
// Limits.

/// The model facts a request is validated against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelShape {
    /// Token ids must be below this.
    pub vocab_size: usize,
    /// MoE layers a routing trace must have (0: dense, no trace accepted).
    pub moe_layers: usize,
    /// Experts per token of a routing trace.
    pub top_k: usize,
    /// Expert ids must be below this.
    pub num_experts: usize,
    /// The model's `max_position_embeddings`: the default (and largest) sequence length limit.
    pub max_positions: usize,
}

impl ModelShape {
    /// The shape of a model configuration.
    pub fn of(cfg: &mxrl_model::ModelConfig) -> ModelShape {
        let moe_layers = (0..cfg.num_layers).filter(|&l| cfg.is_moe_layer(l)).count();
        ModelShape {
            vocab_size: cfg.vocab_size,
            moe_layers,
            top_k: if moe_layers > 0 {
                cfg.num_experts_per_tok
            } else {
                0
            },
            num_experts: cfg.num_experts,
            max_positions: cfg.max_position_embeddings,
        }
    }
}

/// What a server accepts (mirrors `Limits` of the `.proto`); anything larger is refused with
/// `RESOURCE_EXHAUSTED` / `LIMIT_EXCEEDED` before it is allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest bucket payload (bytes).
    pub max_bucket_bytes: u64,
    /// Largest total payload of one update (bytes).
    pub max_update_bytes: u64,
    /// Largest update tensor count (the model's tensor count).
    pub max_tensors: u64,
    /// Largest Generate/Score request message (bytes).
    pub max_request_bytes: u64,
    /// Largest `prompts × n` of a Generate call, and sequences of a Score call.
    pub max_sequences: u64,
    /// Largest `max_new_tokens` (default: the sequence length limit).
    pub max_new_tokens: u64,
    /// Largest prompt + response length (default: the model's `max_position_embeddings`).
    pub max_sequence_length: u64,
    /// The model.
    pub model: ModelShape,
}

/// Default bucket limit floor (256 MiB); raised to the largest tensor when that is larger.
pub const DEFAULT_MAX_BUCKET_BYTES: u64 = 256 << 20;
/// Default limit of sequences per Generate/Score call.
pub const DEFAULT_MAX_SEQUENCES: u64 = 4096;
/// Default Generate/Score request size limit (64 MiB).
pub const DEFAULT_MAX_REQUEST_BYTES: u64 = 64 << 20;
/// Size limit of a control request (Info, Digest, Fetch, Shutdown).
pub const CONTROL_REQUEST_BYTES: u64 = 1 << 10;
/// Framing a bucket message may add to its payload.
pub const BUCKET_FRAMING_BYTES: u64 = 1 << 10;
/// HTTP/2 receive window of one call on both sides (the client's: 4 MiB): how far a sender of
/// weight buckets may run ahead of the receiver.
const STREAM_WINDOW_BYTES: u32 = 4 << 20;
/// HTTP/2 receive window of one connection on both sides (the client's: 16 MiB).
const CONNECTION_WINDOW_BYTES: u32 = 16 << 20;
/// Largest HTTP/2 frame the server accepts (hyper's default: 16 KiB), so a bucket arrives in
/// megabyte frames rather than in tens of thousands of small ones.
const MAX_FRAME_BYTES: u32 = 1 << 20;

impl Limits {
    /// Defaults for a model holding `weights`: a bucket holds at least its largest tensor, an
    /// update at most the model's tensors and their bytes (plus per-tensor framing); a
    /// sequence, and the tokens generated for it, at most the model's positions.
    pub fn for_model(model: ModelShape, weights: &[WireTensor]) -> Limits {
        let record = |t: &WireTensor| t.byte_len() + t.name.len() + 64 + 10 * t.shape.len();
        let largest = weights.iter().map(record).max().unwrap_or(0) as u64;
        let total: u64 = weights.iter().map(|t| record(t) as u64).sum();
        Limits {
            max_bucket_bytes: DEFAULT_MAX_BUCKET_BYTES.max(largest),
            max_update_bytes: total + (1 << 20),
            max_tensors: weights.len() as u64,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            max_sequences: DEFAULT_MAX_SEQUENCES,
            max_new_tokens: model.max_positions as u64,
            max_sequence_length: model.max_positions as u64,
            model,
        }
    }

    fn to_proto(self) -> pb::Limits {
        pb::Limits {
            max_bucket_bytes: self.max_bucket_bytes,
            max_update_bytes: self.max_update_bytes,
            max_request_bytes: self.max_request_bytes,
            max_sequences: self.max_sequences,
            max_new_tokens: self.max_new_tokens,
            max_sequence_length: self.max_sequence_length,
            vocab_size: self.model.vocab_size as u64,
            moe_layers: self.model.moe_layers as u64,
            top_k: self.model.top_k as u64,
            num_experts: self.model.num_experts as u64,
            max_control_request_bytes: CONTROL_REQUEST_BYTES,
        }
    }
}

/// A refused request: what to answer, before the served version is filled in.
#[derive(Debug, Clone, PartialEq)]
struct Refuse {
    code: Code,
    reason: Reason,
    msg: String,
    limit: Option<(&'static str, u64)>,
}

impl Refuse {
    fn invalid(msg: String) -> Refuse {
        Refuse {
            code: Code::InvalidArgument,
            reason: Reason::InvalidRequest,
            msg,
            limit: None,
        }
    }
    fn limit(name: &'static str, limit: u64, msg: String) -> Refuse {
        Refuse {
            code: Code::ResourceExhausted,
            reason: Reason::LimitExceeded,
            msg,
            limit: Some((name, limit)),
        }
    }
    fn status(self, serving: u64) -> Status {
        let r = pb::Refusal {
            reason: self.reason as i32,
            serving_version: serving,
            limit: self.limit.map_or(0, |l| l.1),
            limit_name: self.limit.map_or(String::new(), |l| l.0.to_string()),
        };
        let mut md = MetadataMap::new();
        md.insert_bin(
            pb::REFUSAL_TRAILER,
            tonic::metadata::MetadataValue::from_bytes(&r.encode_to_vec()),
        );
        Status::with_metadata(self.code, self.msg, md)
    }
}

fn check_tokens(l: &Limits, what: &str, ids: &[u32]) -> Result<(), Refuse> {
    if let Some(&t) = ids.iter().find(|&&t| t as usize >= l.model.vocab_size) {
        return Err(Refuse::invalid(format!(
            "{what}: token id {t} is outside the vocabulary of {}",
            l.model.vocab_size
        )));
    }
    Ok(())
}

fn check_sampling(l: &Limits, s: Option<&pb::SamplingConfig>) -> Result<SamplingConfig, Refuse> {
    let s = s.ok_or_else(|| Refuse::invalid("generate: no sampling config".into()))?;
    if !(s.temperature.is_finite() && s.temperature > 0.0) {
        return Err(Refuse::invalid(format!(
            "generate: temperature {} (expected a finite value > 0)",
            s.temperature
        )));
    }
    if !(s.top_p > 0.0 && s.top_p <= 1.0) {
        return Err(Refuse::invalid(format!(
            "generate: top_p {} (expected 0 < top_p <= 1)",
            s.top_p
        )));
    }
    if s.max_new_tokens > l.max_new_tokens {
        return Err(Refuse::limit(
            "max_new_tokens",
            l.max_new_tokens,
            format!(
                "generate: max_new_tokens {} exceeds the limit {}",
                s.max_new_tokens, l.max_new_tokens
            ),
        ));
    }
    Ok(SamplingConfig {
        temperature: s.temperature,
        top_p: s.top_p,
        max_new_tokens: s.max_new_tokens as usize,
    })
}

/// A validated generate request.
struct GenJob {
    prompts: Vec<Vec<u32>>,
    n: usize,
    cfg: SamplingConfig,
    eos: u32,
    seed: u64,
}

fn check_generate(l: &Limits, r: pb::GenerateRequest) -> Result<GenJob, Refuse> {
    let cfg = check_sampling(l, r.sampling.as_ref())?;
    let total = (r.prompts.len() as u64).checked_mul(r.n);
    if total.is_none_or(|t| t > l.max_sequences) {
        return Err(Refuse::limit(
            "max_sequences",
            l.max_sequences,
            format!(
                "generate: {} prompts × n = {} samples exceeds the limit {}",
                r.prompts.len(),
                r.n,
                l.max_sequences
            ),
        ));
    }
    if r.eos as usize >= l.model.vocab_size {
        return Err(Refuse::invalid(format!(
            "generate: eos {} is outside the vocabulary of {}",
            r.eos, l.model.vocab_size
        )));
    }
    for (i, p) in r.prompts.iter().enumerate() {
        if p.ids.is_empty() {
            return Err(Refuse::invalid(format!("generate: prompt {i} is empty")));
        }
        let len = p.ids.len() as u64 + cfg.max_new_tokens as u64;
        if len > l.max_sequence_length {
            return Err(Refuse::limit(
                "max_sequence_length",
                l.max_sequence_length,
                format!(
                    "generate: prompt {i} of {} tokens + max_new_tokens {} exceeds the \
                     sequence length limit {}",
                    p.ids.len(),
                    cfg.max_new_tokens,
                    l.max_sequence_length
                ),
            ));
        }
        check_tokens(l, &format!("generate: prompt {i}"), &p.ids)?;
    }
    Ok(GenJob {
        prompts: r.prompts.into_iter().map(|p| p.ids).collect(),
        n: r.n as usize,
        cfg,
        eos: r.eos,
        seed: r.seed,
    })
}

/// An owned, validated [`TrainSeq`].
struct OwnedSeq {
    prompt: Vec<u32>,
    response: Vec<u32>,
    replay: Option<RoutingTrace>,
}

/// A routing trace must fit the model exactly: its layers and top-k, one entry per position
/// fed to the model (`positions`), expert ids below the expert count, finite weights.
fn check_trace(
    l: &Limits,
    what: &str,
    t: pb::RoutingTrace,
    positions: usize,
) -> Result<RoutingTrace, Refuse> {
    let m = &l.model;
    if m.moe_layers == 0 {
        return Err(Refuse::invalid(format!(
            "{what}: a routing trace for a model without MoE layers"
        )));
    }
    if t.layers != m.moe_layers as u64 || t.top_k != m.top_k as u64 {
        return Err(Refuse::invalid(format!(
            "{what}: routing trace of {} layers × top-{} (the model has {} MoE layers, top-{})",
            t.layers, t.top_k, m.moe_layers, m.top_k
        )));
    }
    let want = positions * m.moe_layers * m.top_k;
    if t.ids.len() != want || t.weights.len() != want {
        return Err(Refuse::invalid(format!(
            "{what}: routing trace with {} ids and {} weights, expected {want} ({positions} \
             positions × {} layers × top-{})",
            t.ids.len(),
            t.weights.len(),
            m.moe_layers,
            m.top_k
        )));
    }
    if let Some(&e) = t.ids.iter().find(|&&e| e as usize >= m.num_experts) {
        return Err(Refuse::invalid(format!(
            "{what}: routing trace names expert {e}, the model has {}",
            m.num_experts
        )));
    }
    if t.weights.iter().any(|w| !w.is_finite()) {
        return Err(Refuse::invalid(format!(
            "{what}: routing trace has a non-finite weight"
        )));
    }
    Ok(trace_from_wire(m.moe_layers, m.top_k, &t.ids, &t.weights))
}

fn check_score(l: &Limits, r: pb::ScoreRequest) -> Result<(f32, Vec<OwnedSeq>), Refuse> {
    if !(r.temperature.is_finite() && r.temperature > 0.0) {
        return Err(Refuse::invalid(format!(
            "score: temperature {} (expected a finite value > 0)",
            r.temperature
        )));
    }
    if r.sequences.len() as u64 > l.max_sequences {
        return Err(Refuse::limit(
            "max_sequences",
            l.max_sequences,
            format!(
                "score: {} sequences exceeds the limit {}",
                r.sequences.len(),
                l.max_sequences
            ),
        ));
    }
    let with_replay = r.sequences.iter().filter(|s| s.replay.is_some()).count();
    if with_replay != 0 && with_replay != r.sequences.len() {
        return Err(Refuse::invalid(format!(
            "score: {with_replay} of {} sequences carry a routing trace (all or none)",
            r.sequences.len()
        )));
    }
    let mut out = Vec::with_capacity(r.sequences.len());
    for (i, s) in r.sequences.into_iter().enumerate() {
        let what = format!("score: sequence {i}");
        if s.prompt.is_empty() || s.response.is_empty() {
            return Err(Refuse::invalid(format!(
                "{what}: prompt of {} and response of {} tokens (both must be non-empty)",
                s.prompt.len(),
                s.response.len()
            )));
        }
        let len = s.prompt.len() + s.response.len();
        if len as u64 > l.max_sequence_length {
            return Err(Refuse::limit(
                "max_sequence_length",
                l.max_sequence_length,
                format!(
                    "{what}: {len} tokens exceeds the sequence length limit {}",
                    l.max_sequence_length
                ),
            ));
        }
        check_tokens(l, &what, &s.prompt)?;
        check_tokens(l, &what, &s.response)?;
        let replay = match s.replay {
            None => None,
            Some(t) => Some(check_trace(l, &what, t, len - 1)?),
        };
        out.push(OwnedSeq {
            prompt: s.prompt,
            response: s.response,
            replay,
        });
    }
    Ok((r.temperature, out))
}

// ---------------------------------------------------------------------------------------------
// Conversions.

/// A trace in the wire layout: `[position][layer][k]` flattened.
fn trace_to_proto(t: &RoutingTrace) -> pb::RoutingTrace {
    let (l, k, n) = (t.layers.len(), t.top_k(), t.num_tokens());
    let mut ids = Vec::with_capacity(n * l * k);
    let mut weights = Vec::with_capacity(n * l * k);
    for p in 0..n {
        for r in &t.layers {
            ids.extend_from_slice(&r.ids[p * k..(p + 1) * k]);
            weights.extend_from_slice(&r.weights[p * k..(p + 1) * k]);
        }
    }
    pb::RoutingTrace {
        layers: l as u64,
        top_k: k as u64,
        ids,
        weights,
    }
}

/// The trace of the wire layout `[position][layers][top_k]` (`ids` and `weights` of a whole
/// number of positions, checked by the caller).
fn trace_from_wire(layers: usize, top_k: usize, ids: &[u32], weights: &[f32]) -> RoutingTrace {
    let n = ids.len().checked_div(layers * top_k).unwrap_or(0);
    RoutingTrace {
        layers: (0..layers)
            .map(|li| {
                let (mut r_ids, mut r_w) = (Vec::with_capacity(n * top_k), Vec::new());
                for p in 0..n {
                    let b = (p * layers + li) * top_k;
                    r_ids.extend_from_slice(&ids[b..b + top_k]);
                    r_w.extend_from_slice(&weights[b..b + top_k]);
                }
                mxrl_model::Routes {
                    top_k,
                    ids: r_ids,
                    weights: r_w,
                }
            })
            .collect(),
    }
}

fn sample_to_proto(s: Sample) -> pb::Sample {
    pb::Sample {
        prompt_index: s.prompt_index as u64,
        prompt: s.prompt,
        response: s.response,
        logprobs: s.logprobs,
        routing: s.routing.as_ref().map(trace_to_proto),
        probes: s.probes.map(|p| pb::LayerProbes {
            layers: p.layers as u64,
            width: p.width as u64,
            values: p.values,
        }),
    }
}

fn usize_of(v: u64, what: &str) -> Result<usize, String> {
    usize::try_from(v).map_err(|_| format!("{what} {v} does not fit this machine"))
}

/// Most MoE layers a received routing trace may name (each is allocated, even without
/// positions).
const MAX_TRACE_LAYERS: usize = 1 << 16;

fn sample_from_proto(s: pb::Sample) -> Result<Sample, String> {
    Ok(Sample {
        prompt_index: usize_of(s.prompt_index, "prompt index")?,
        prompt: s.prompt,
        response: s.response,
        logprobs: s.logprobs,
        routing: s
            .routing
            .map(|t| {
                let l = usize_of(t.layers, "routing layers")?;
                let k = usize_of(t.top_k, "routing top-k")?;
                let cell = l.saturating_mul(k);
                let whole = match cell {
                    0 => t.ids.is_empty(),
                    c => t.ids.len() % c == 0,
                };
                if t.ids.len() != t.weights.len() || !whole || l > MAX_TRACE_LAYERS {
                    return Err(format!(
                        "routing trace with {} ids and {} weights for {l} layers × top-{k}",
                        t.ids.len(),
                        t.weights.len()
                    ));
                }
                Ok(trace_from_wire(l, k, &t.ids, &t.weights))
            })
            .transpose()?,
        probes: s
            .probes
            .map(|p| {
                Ok::<_, String>(LayerProbes {
                    layers: usize_of(p.layers, "probe layers")?,
                    width: usize_of(p.width, "probe width")?,
                    values: p.values,
                })
            })
            .transpose()?,
    })
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
    /// The nonce the server was started with (empty when none).
    pub instance: String,
    /// Largest bucket payload the server accepts.
    pub max_bucket_bytes: u64,
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

fn amax_bytes(t: &WireTensor) -> Vec<u8> {
    t.amax.iter().flat_map(|a| a.to_le_bytes()).collect()
}

impl TensorDigest {
    /// Digests of `t`.
    pub fn of(t: &WireTensor) -> TensorDigest {
        TensorDigest {
            name: t.name.clone(),
            format: t.format,
            shape: t.shape.clone(),
            data: hex(&sha256(&t.data)),
            scales: hex(&sha256(&t.scales)),
            amax: hex(&sha256(&amax_bytes(t))),
        }
    }
}

fn digest_to_proto(t: &WireTensor) -> pb::TensorDigest {
    pb::TensorDigest {
        name: t.name.clone(),
        format: format_to_proto(t.format) as i32,
        shape: t.shape.iter().map(|&d| d as u64).collect(),
        data_sha256: sha256(&t.data).to_vec(),
        scales_sha256: sha256(&t.scales).to_vec(),
        amax_sha256: sha256(&amax_bytes(t)).to_vec(),
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
// Server: events.

/// Something that happened on the server, for its log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerEvent {
    /// A weight update was verified and applied.
    Applied {
        /// The sender.
        peer: String,
        /// What was applied.
        version: u64,
        /// Payload bytes.
        bytes: u64,
        /// Buckets.
        buckets: u32,
        /// From the header to the last bucket verified and decoded (the transfer, the
        /// buckets' SHA-256 and their decoding).
        receive: Duration,
        /// Installing the verified tensors on the engine thread (waiting for a call in
        /// flight included).
        install: Duration,
    },
    /// A weight update was refused; nothing changed.
    Refused {
        /// The sender.
        peer: String,
        /// The version still served.
        serving: u64,
        /// Why.
        error: String,
    },
    /// An update stream broke before its commit; nothing changed.
    Dropped {
        /// The client.
        peer: String,
        /// The version still served.
        serving: u64,
        /// What was going on and the transport error.
        error: String,
    },
    /// A generate/score/fetch call was refused or failed.
    Failed {
        /// The client.
        peer: String,
        /// The call.
        request: &'static str,
        /// Why.
        error: String,
    },
    /// A call without the right token was refused.
    Unauthenticated {
        /// The client.
        peer: String,
    },
    /// A TLS connection closed before its handshake completed (a client without TLS, one
    /// that does not accept the certificate, a protocol mismatch, the handshake timeout).
    TlsHandshakeFailed {
        /// The client.
        peer: String,
        /// What the connection saw.
        error: String,
    },
    /// `accept` failed (e.g. out of file descriptors); the server retries.
    AcceptFailed {
        /// The error.
        error: String,
    },
    /// Shutdown was requested (by a client or the stop handle).
    Shutdown {
        /// Who asked.
        peer: String,
    },
}

impl std::fmt::Display for ServerEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServerEvent::Applied {
                peer,
                version,
                bytes,
                buckets,
                receive,
                install,
            } => write!(
                f,
                "{peer}: applied weight version {version} ({bytes} bytes in {buckets} buckets; \
                 received and verified in {:.1} ms, installed in {:.1} ms)",
                receive.as_secs_f64() * 1e3,
                install.as_secs_f64() * 1e3
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
                "{peer}: update stream dropped ({error}); still serving v{serving}"
            ),
            ServerEvent::Failed {
                peer,
                request,
                error,
            } => write!(f, "{peer}: {request} refused: {error}"),
            ServerEvent::Unauthenticated { peer } => {
                write!(f, "{peer}: call without a valid token refused")
            }
            ServerEvent::TlsHandshakeFailed { peer, error } => {
                write!(
                    f,
                    "{peer}: TLS handshake failed ({error}); connection closed"
                )
            }
            ServerEvent::AcceptFailed { error } => {
                write!(f, "accept failed ({error}); retrying")
            }
            ServerEvent::Shutdown { peer } => write!(f, "{peer}: shutdown requested"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Server: the engine thread.

/// What `Info` and `Digest` read without waiting for the engine.
struct Snapshot {
    version: u64,
    tensors: usize,
    weight_bytes: u64,
    /// The digest of the served weights: computed at start, and after an update on the first
    /// `Digest` call (on the engine thread, from the weights it holds), not by the update.
    digest: Option<Arc<pb::DigestReply>>,
}

/// The digest of the weights `e` holds now (copied from where they live, hashed in
/// parallel).
fn digest_of<P: RolloutPolicy>(e: &RolloutEngine<P>) -> (Vec<WireTensor>, pb::DigestReply) {
    let w = e.policy.weights();
    let tensors = w.par_iter().map(digest_to_proto).collect();
    (
        w,
        pb::DigestReply {
            version: e.version,
            tensors,
        },
    )
}

fn snapshot_of<P: RolloutPolicy>(e: &RolloutEngine<P>) -> Snapshot {
    let (w, d) = digest_of(e);
    Snapshot {
        version: e.version,
        tensors: w.len(),
        weight_bytes: w.iter().map(|t| t.byte_len() as u64).sum(),
        digest: Some(Arc::new(d)),
    }
}

type Reply<T> = oneshot::Sender<Result<T, Refuse>>;

enum Job {
    Generate(GenJob, Reply<(u64, Vec<Sample>)>),
    Score(f32, Vec<OwnedSeq>, Reply<(u64, Vec<Vec<f32>>)>),
    Install(u64, Vec<WireTensor>, Reply<u64>),
    Weights(oneshot::Sender<(u64, Vec<WireTensor>)>),
    Digest(Reply<Arc<pb::DigestReply>>),
}

fn engine_error(msg: String) -> Refuse {
    Refuse {
        code: Code::Internal,
        reason: Reason::EngineError,
        msg,
        limit: None,
    }
}

/// Run `f`, turning a panic into an `ENGINE_ERROR` refusal.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, Refuse>) -> Result<T, Refuse> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string panic".into());
            Err(engine_error(format!(
                "{what}: the engine panicked ({msg}); the request was dropped, the engine \
                 keeps serving"
            )))
        }
    }
}

fn engine_loop<P: RolloutPolicy>(
    mut eng: RolloutEngine<P>,
    jobs: mpsc::Receiver<Job>,
    snap: Arc<RwLock<Snapshot>>,
) {
    for job in jobs {
        match job {
            Job::Generate(g, tx) => {
                let r = guarded("generate", || {
                    eng.policy
                        .generate(&g.prompts, g.n, &g.cfg, g.eos, g.seed)
                        .map_err(|e| engine_error(format!("generate: {e}")))
                });
                let _ = tx.send(r.map(|s| (eng.version, s)));
            }
            Job::Score(t, seqs, tx) => {
                let batch: Vec<TrainSeq<'_>> = seqs
                    .iter()
                    .map(|s| TrainSeq {
                        prompt: &s.prompt,
                        response: &s.response,
                        replay: s.replay.as_ref(),
                    })
                    .collect();
                let r = guarded("score", || {
                    eng.policy
                        .score(&batch, t)
                        .map_err(|e| engine_error(format!("score: {e}")))
                });
                let _ = tx.send(r.map(|l| (eng.version, l)));
            }
            Job::Install(v, tensors, tx) => {
                let r = guarded("weight update", || {
                    eng.install(v, &tensors).map_err(|e| refuse_sync(&e))
                });
                if r.is_ok() {
                    // What the engine now holds is exactly these tensors (the policy installs
                    // a whole set or nothing); their digest is computed when asked for.
                    *snap.write().unwrap_or_else(|p| p.into_inner()) = Snapshot {
                        version: eng.version,
                        tensors: tensors.len(),
                        weight_bytes: tensors.iter().map(|t| t.byte_len() as u64).sum(),
                        digest: None,
                    };
                }
                drop(tensors);
                let _ = tx.send(r.map(|()| eng.version));
            }
            Job::Digest(tx) => {
                let r = guarded("weight digest", || Ok(Arc::new(digest_of(&eng).1)));
                if let Ok(d) = &r {
                    let mut s = snap.write().unwrap_or_else(|p| p.into_inner());
                    if s.version == d.version {
                        s.digest = Some(d.clone());
                    }
                }
                let _ = tx.send(r);
            }
            Job::Weights(tx) => {
                if let Ok(w) = guarded("fetch", || Ok(eng.policy.weights())) {
                    let _ = tx.send((eng.version, w));
                }
            }
        }
    }
}

/// The typed refusal of a weight-sync error.
fn refuse_sync(e: &SyncError) -> Refuse {
    let (code, reason) = match e {
        SyncError::ContractMismatch { .. } => (Code::FailedPrecondition, Reason::ContractMismatch),
        SyncError::Stale { .. } => (Code::FailedPrecondition, Reason::StaleVersion),
        SyncError::Bucket { msg, .. } if msg.contains("SHA-256") => {
            (Code::DataLoss, Reason::BadChecksum)
        }
        SyncError::Bucket { .. } | SyncError::Transport(_) => {
            (Code::InvalidArgument, Reason::BadUpdate)
        }
        SyncError::Incomplete { .. } => (Code::InvalidArgument, Reason::Incomplete),
        SyncError::Policy { .. } => (Code::InvalidArgument, Reason::RejectedTensors),
        SyncError::Limit { what, limit, .. } => {
            return Refuse {
                code: Code::ResourceExhausted,
                reason: Reason::LimitExceeded,
                msg: e.to_string(),
                limit: Some((
                    match *what {
                        "bytes" => "max_update_bytes",
                        _ => "max_tensors",
                    },
                    *limit,
                )),
            }
        }
        SyncError::Rejected(_) | SyncError::CheckFailed { .. } => {
            (Code::Internal, Reason::EngineError)
        }
    };
    Refuse {
        code,
        reason,
        msg: e.to_string(),
        limit: None,
    }
}

// ---------------------------------------------------------------------------------------------
// Server: the services.

/// Who is calling (from the connection).
#[derive(Debug, Clone)]
struct ConnInfo(String);

fn peer_of<T>(r: &Request<T>) -> String {
    peer_in(r.extensions())
}

/// The peer of a call from its request's extensions (tonic inserts the connection's
/// [`ConnInfo`], and for a TLS connection also the TLS wrapper of it).
fn peer_in(ext: &tonic::Extensions) -> String {
    if let Some(c) = ext.get::<tonic::transport::server::TlsConnectInfo<ConnInfo>>() {
        return format!("{} (TLS)", c.get_ref().0);
    }
    ext.get::<ConnInfo>()
        .map_or_else(|| "client".into(), |c| c.0.clone())
}

struct Inner {
    jobs: Mutex<mpsc::Sender<Job>>,
    snap: Arc<RwLock<Snapshot>>,
    cfg: ServerConfig,
    contract_hash: String,
    events: Mutex<mpsc::Sender<ServerEvent>>,
    update_slot: Arc<Semaphore>,
    stop: watch::Sender<bool>,
}

#[derive(Clone)]
struct Svc(Arc<Inner>);

impl Svc {
    fn serving(&self) -> u64 {
        self.0.snap.read().map_or(0, |s| s.version)
    }
    fn event(&self, e: ServerEvent) {
        let _ = self
            .0
            .events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(e);
    }
    fn refuse(&self, peer: &str, request: &'static str, r: Refuse) -> Status {
        self.event(ServerEvent::Failed {
            peer: peer.into(),
            request,
            error: r.msg.clone(),
        });
        r.status(self.serving())
    }
    fn submit(&self, job: Job) -> Result<(), Status> {
        self.0
            .jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(job)
            .map_err(|_| Status::unavailable("the rollout engine has stopped"))
    }
    async fn run<T: Send>(
        &self,
        peer: &str,
        request: &'static str,
        job: impl FnOnce(Reply<T>) -> Job,
    ) -> Result<T, Status> {
        let (tx, rx) = oneshot::channel();
        self.submit(job(tx))?;
        match rx.await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(r)) => Err(self.refuse(peer, request, r)),
            Err(_) => Err(self.refuse(
                peer,
                request,
                engine_error(format!("{request}: the engine dropped the request")),
            )),
        }
    }
}

type UpdateStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::UpdateMessage, Status>> + Send>>;

fn update_messages(u: WeightUpdate) -> impl Iterator<Item = pb::UpdateMessage> {
    use pb::update_message::Kind;
    let h = u.header;
    let version = h.version;
    std::iter::once(Kind::Header(pb::UpdateHeader {
        version,
        contract_hash: h.contract_hash,
        buckets: h.buckets,
        tensors: h.tensors,
        bytes: h.bytes,
    }))
    .chain(u.buckets.into_iter().map(|b| {
        Kind::Bucket(pb::WeightBucket {
            index: b.index,
            sha256: b.checksum.to_vec(),
            payload: b.payload,
        })
    }))
    .chain(std::iter::once(Kind::Commit(pb::Commit { version })))
    .map(|k| pb::UpdateMessage { kind: Some(k) })
}

#[tonic::async_trait]
impl pb::rollout_server::Rollout for Svc {
    async fn info(&self, _r: Request<pb::InfoRequest>) -> Result<Response<pb::InfoReply>, Status> {
        let (version, tensors, weight_bytes) = {
            let s = self.0.snap.read().unwrap_or_else(|p| p.into_inner());
            (s.version, s.tensors as u64, s.weight_bytes)
        };
        let c = &self.0.cfg;
        Ok(Response::new(pb::InfoReply {
            protocol: PROTOCOL,
            version,
            contract_hash: self.0.contract_hash.clone(),
            recipe: c.recipe.clone(),
            model: c.model.clone(),
            tensors,
            weight_bytes,
            instance: c.instance.clone(),
            limits: Some(c.limits.to_proto()),
        }))
    }

    async fn digest(
        &self,
        r: Request<pb::DigestRequest>,
    ) -> Result<Response<pb::DigestReply>, Status> {
        let held = self
            .0
            .snap
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .digest
            .clone();
        let d = match held {
            Some(d) => d,
            None => self.run(&peer_of(&r), "digest", Job::Digest).await?,
        };
        Ok(Response::new((*d).clone()))
    }

    type FetchStream = UpdateStream;

    async fn fetch(&self, r: Request<pb::FetchRequest>) -> Result<Response<UpdateStream>, Status> {
        let peer = peer_of(&r);
        let max = self.0.cfg.limits.max_bucket_bytes;
        let bucket = match r.into_inner().bucket_bytes {
            0 => max,
            b => b.min(max),
        };
        let (tx, rx) = oneshot::channel();
        self.submit(Job::Weights(tx))?;
        let (version, w) = rx.await.map_err(|_| {
            self.refuse(
                &peer,
                "fetch",
                engine_error("fetch: the engine dropped the request".into()),
            )
        })?;
        let u = WeightUpdate::build(version, &self.0.contract_hash, &w, bucket as usize);
        drop(w);
        Ok(Response::new(Box::pin(tokio_stream::iter(
            update_messages(u).map(Ok),
        ))))
    }

    async fn shutdown(
        &self,
        r: Request<pb::ShutdownRequest>,
    ) -> Result<Response<pb::ShutdownReply>, Status> {
        self.event(ServerEvent::Shutdown { peer: peer_of(&r) });
        let _ = self.0.stop.send(true);
        Ok(Response::new(pb::ShutdownReply {
            version: self.serving(),
        }))
    }
}

#[tonic::async_trait]
impl pb::sampler_server::Sampler for Svc {
    async fn generate(
        &self,
        r: Request<pb::GenerateRequest>,
    ) -> Result<Response<pb::GenerateReply>, Status> {
        let peer = peer_of(&r);
        let g = check_generate(&self.0.cfg.limits, r.into_inner())
            .map_err(|e| self.refuse(&peer, "generate", e))?;
        let (version, samples) = self
            .run(&peer, "generate", |tx| Job::Generate(g, tx))
            .await?;
        Ok(Response::new(pb::GenerateReply {
            version,
            samples: samples.into_iter().map(sample_to_proto).collect(),
        }))
    }

    async fn score(
        &self,
        r: Request<pb::ScoreRequest>,
    ) -> Result<Response<pb::ScoreReply>, Status> {
        let peer = peer_of(&r);
        let (t, seqs) = check_score(&self.0.cfg.limits, r.into_inner())
            .map_err(|e| self.refuse(&peer, "score", e))?;
        let (version, lps) = self
            .run(&peer, "score", |tx| Job::Score(t, seqs, tx))
            .await?;
        Ok(Response::new(pb::ScoreReply {
            version,
            logprobs: lps
                .into_iter()
                .map(|values| pb::Logprobs { values })
                .collect(),
        }))
    }
}

fn bad_update(msg: String) -> Refuse {
    Refuse {
        code: Code::InvalidArgument,
        reason: Reason::BadUpdate,
        msg,
        limit: None,
    }
}

/// A bucket being verified and decoded on the blocking pool ([`Svc::receive_update`]).
type Check = tokio::task::JoinHandle<Result<(u32, Vec<WireTensor>), SyncError>>;

/// Stores the buckets of `checks` whose verification finished (all of them with `all`, waiting
/// for each), removing them; the first failure is returned.
async fn settle(
    asm: &mut UpdateAssembler,
    checks: &mut Vec<Check>,
    all: bool,
) -> Result<(), SyncError> {
    let mut i = 0;
    while i < checks.len() {
        if !all && !checks[i].is_finished() {
            i += 1;
            continue;
        }
        match checks.swap_remove(i).await {
            Ok(Ok((index, tensors))) => asm.fill(index, tensors),
            Ok(Err(e)) => return Err(e),
            Err(e) => {
                return Err(SyncError::Rejected(format!(
                    "verifying a bucket failed: {e}"
                )))
            }
        }
    }
    Ok(())
}

/// An update received and applied ([`Svc::receive_update`]).
struct Received {
    version: u64,
    bytes: u64,
    buckets: u32,
    receive: Duration,
    install: Duration,
}

impl Svc {
    /// Receive one update from `s`; `Ok` once it is applied.
    async fn receive_update(
        &self,
        s: &mut tonic::Streaming<pb::UpdateMessage>,
    ) -> Result<Received, Result<Refuse, String>> {
        use pb::update_message::Kind;
        let l = &self.0.cfg.limits;
        let next = |m: Result<Option<pb::UpdateMessage>, Status>| match m {
            Ok(Some(pb::UpdateMessage { kind: Some(k) })) => Ok(Some(k)),
            Ok(Some(_)) => Err(Ok(bad_update("an update message without a kind".into()))),
            Ok(None) => Ok(None),
            // A message over the size limit is refused by tonic while decoding.
            Err(st) if st.code() == Code::OutOfRange || st.code() == Code::ResourceExhausted => {
                Err(Ok(Refuse::limit(
                    "max_bucket_bytes",
                    l.max_bucket_bytes,
                    format!("update message refused: {}", st.message()),
                )))
            }
            Err(st) => Err(Err(format!("{}: {}", st.code(), st.message()))),
        };
        let h = match next(s.message().await)? {
            Some(Kind::Header(h)) => h,
            Some(_) => {
                return Err(Ok(bad_update(
                    "the first message of an update must be its header".into(),
                )))
            }
            None => {
                return Err(Ok(Refuse {
                    code: Code::InvalidArgument,
                    reason: Reason::Incomplete,
                    msg: "the update stream ended before its header".into(),
                    limit: None,
                }))
            }
        };
        let started = std::time::Instant::now();
        let header = UpdateHeader {
            version: h.version,
            contract_hash: h.contract_hash,
            buckets: h.buckets,
            tensors: h.tensors,
            bytes: h.bytes,
        };
        let v = header.version;
        let serving = self.serving();
        let mut asm = UpdateAssembler::begin_bounded(
            header,
            &self.0.contract_hash,
            l.max_tensors,
            l.max_update_bytes,
        )
        .map_err(|e| Ok(refuse_sync(&e)))?;
        if v <= serving {
            return Err(Ok(refuse_sync(&SyncError::Stale {
                got: v,
                current: serving,
            })));
        }
        // Each bucket's SHA-256 and decoding run on the blocking pool while the next bucket
        // arrives; the first failure among those finished ends the update, and all of them
        // are settled before anything else (the commit, the end of the stream, an error).
        let mut checks: Vec<Check> = Vec::new();
        loop {
            let m = s.message().await;
            let all = !matches!(
                m,
                Ok(Some(pb::UpdateMessage {
                    kind: Some(Kind::Bucket(_))
                }))
            );
            settle(&mut asm, &mut checks, all)
                .await
                .map_err(|e| Ok(refuse_sync(&e)))?;
            match next(m)? {
                Some(Kind::Bucket(b)) => {
                    if b.payload.len() as u64 > l.max_bucket_bytes {
                        return Err(Ok(Refuse::limit(
                            "max_bucket_bytes",
                            l.max_bucket_bytes,
                            format!(
                                "weight update v{v}: bucket {} of {} bytes exceeds the limit {}",
                                b.index,
                                b.payload.len(),
                                l.max_bucket_bytes
                            ),
                        )));
                    }
                    let checksum: [u8; 32] = b.sha256.as_slice().try_into().map_err(|_| {
                        Ok(bad_update(format!(
                            "weight update v{v}: bucket {} carries a {}-byte checksum, expected \
                             32 (SHA-256)",
                            b.index,
                            b.sha256.len()
                        )))
                    })?;
                    asm.admit(b.index, b.payload.len())
                        .map_err(|e| Ok(refuse_sync(&e)))?;
                    let bucket = Bucket {
                        index: b.index,
                        checksum,
                        payload: b.payload,
                    };
                    checks.push(tokio::task::spawn_blocking(move || {
                        verify_bucket(v, &bucket).map(|t| (bucket.index, t))
                    }));
                }
                Some(Kind::Commit(c)) => {
                    if c.version != v {
                        return Err(Ok(bad_update(format!(
                            "weight update v{v}: the commit names version v{}",
                            c.version
                        ))));
                    }
                    break;
                }
                Some(Kind::Header(_)) => {
                    return Err(Ok(bad_update(format!(
                        "weight update v{v}: a second header before the commit"
                    ))))
                }
                None => {
                    return Err(Ok(Refuse {
                        code: Code::InvalidArgument,
                        reason: Reason::Incomplete,
                        msg: format!(
                            "weight update v{v}: the stream ended before its commit; the \
                             partial update was discarded"
                        ),
                        limit: None,
                    }))
                }
            }
        }
        let (bytes, buckets) = (asm.header().bytes, asm.header().buckets);
        let (version, tensors) = asm.finish().map_err(|e| Ok(refuse_sync(&e)))?;
        let receive = started.elapsed();
        let installing = std::time::Instant::now();
        let (tx, rx) = oneshot::channel();
        self.submit(Job::Install(version, tensors, tx))
            .map_err(|e| Err(e.message().to_string()))?;
        match rx.await {
            Ok(Ok(v)) => Ok(Received {
                version: v,
                bytes,
                buckets,
                receive,
                install: installing.elapsed(),
            }),
            Ok(Err(r)) => Err(Ok(r)),
            Err(_) => Err(Ok(engine_error("the engine dropped the update".into()))),
        }
    }
}

#[tonic::async_trait]
impl pb::weight_sync_server::WeightSync for Svc {
    async fn update_weights(
        &self,
        r: Request<tonic::Streaming<pb::UpdateMessage>>,
    ) -> Result<Response<pb::UpdateReply>, Status> {
        let peer = peer_of(&r);
        let Ok(_slot) = self.0.update_slot.clone().try_acquire_owned() else {
            let st = Refuse {
                code: Code::Aborted,
                reason: Reason::Busy,
                msg: "another weight update is in progress; retry after it".into(),
                limit: None,
            };
            self.event(ServerEvent::Refused {
                peer,
                serving: self.serving(),
                error: st.msg.clone(),
            });
            return Err(st.status(self.serving()));
        };
        let mut s = r.into_inner();
        match self.receive_update(&mut s).await {
            Ok(Received {
                version,
                bytes,
                buckets,
                receive,
                install,
            }) => {
                self.event(ServerEvent::Applied {
                    peer,
                    version,
                    bytes,
                    buckets,
                    receive,
                    install,
                });
                Ok(Response::new(pb::UpdateReply {
                    version,
                    bytes,
                    buckets,
                }))
            }
            Err(Ok(refuse)) => {
                let serving = self.serving();
                self.event(ServerEvent::Refused {
                    peer,
                    serving,
                    error: refuse.msg.clone(),
                });
                Err(refuse.status(serving))
            }
            Err(Err(transport)) => {
                let serving = self.serving();
                self.event(ServerEvent::Dropped {
                    peer,
                    serving,
                    error: format!(
                        "before its commit: {transport}; the partial update was discarded"
                    ),
                });
                Err(Status::cancelled(transport))
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Server: connections.

/// A connection: the socket, a slot of the connection cap (released when it closes) and an
/// idle deadline (no byte from the peer for `idle` closes it).
struct Conn<IO> {
    io: IO,
    _slot: OwnedSemaphorePermit,
    idle: Duration,
    deadline: Pin<Box<tokio::time::Sleep>>,
    peer: String,
    /// On a TLS listener, until the handshake completed.
    handshake: Option<Handshake>,
}

/// A TLS connection's handshake, watched for its failure. tonic runs the handshake itself and
/// drops a connection whose handshake failed with nothing but a debug trace; it asks a
/// connection for its [`Connected::connect_info`](tonic::transport::server::Connected) only
/// when it starts serving it, after the handshake. A connection dropped before that reports
/// [`ServerEvent::TlsHandshakeFailed`] with what it saw on the socket.
struct Handshake {
    done: std::sync::atomic::AtomicBool,
    started: std::time::Instant,
    /// The first end of the byte stream seen during the handshake (an error, the peer's EOF).
    seen: Option<String>,
    events: mpsc::Sender<ServerEvent>,
}

impl<IO> Conn<IO> {
    /// Remember `what` as the reason a pending handshake may fail.
    fn note(&mut self, what: impl FnOnce() -> String) {
        if let Some(h) = &mut self.handshake {
            if h.seen.is_none() && !h.done.load(std::sync::atomic::Ordering::Relaxed) {
                h.seen = Some(what());
            }
        }
    }
}

impl<IO> Drop for Conn<IO> {
    fn drop(&mut self) {
        let Some(h) = self.handshake.take() else {
            return;
        };
        if h.done.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let error = match h.seen {
            Some(e) => e,
            None if h.started.elapsed() >= TLS_HANDSHAKE_TIMEOUT => {
                format!("not completed within {} s", TLS_HANDSHAKE_TIMEOUT.as_secs())
            }
            None => "refused by TLS: not a TLS client, a certificate the client does not \
                     accept, or a protocol mismatch"
                .into(),
        };
        let _ = h.events.send(ServerEvent::TlsHandshakeFailed {
            peer: std::mem::take(&mut self.peer),
            error,
        });
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Conn<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let wanted = buf.remaining() > 0;
        match Pin::new(&mut self.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    let at = tokio::time::Instant::now() + self.idle;
                    self.deadline.as_mut().reset(at);
                } else if wanted {
                    self.note(|| "the client closed the connection".into());
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match std::future::Future::poll(self.deadline.as_mut(), cx) {
                Poll::Ready(()) => {
                    let idle = self.idle;
                    self.note(|| format!("no byte from the client for {idle:?}"));
                    Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "idle connection closed",
                    )))
                }
                Poll::Pending => Poll::Pending,
            },
            Poll::Ready(Err(e)) => {
                self.note(|| format!("reading: {e}"));
                Poll::Ready(Err(e))
            }
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Conn<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        if let Poll::Ready(Err(e)) = &r {
            self.note(|| format!("writing: {e}"));
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Err(e)) = &r {
            self.note(|| format!("writing: {e}"));
        }
        r
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<IO> tonic::transport::server::Connected for Conn<IO> {
    type ConnectInfo = ConnInfo;
    fn connect_info(&self) -> ConnInfo {
        if let Some(h) = &self.handshake {
            h.done.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        ConnInfo(self.peer.clone())
    }
}

/// Accepting connections: every accept waits for a slot of the connection cap; an accept
/// error is reported and retried after a pause.
trait Acceptor: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept(
        &self,
    ) -> impl std::future::Future<Output = std::io::Result<(Self::Io, String)>> + Send;
}

impl Acceptor for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept(&self) -> std::io::Result<(Self::Io, String)> {
        let (s, a) = tokio::net::TcpListener::accept(self).await?;
        let _ = s.set_nodelay(true);
        Ok((s, format!("tcp:{a}")))
    }
}

struct UnixAcceptor(
    tokio::net::UnixListener,
    String,
    std::sync::atomic::AtomicU64,
);

impl Acceptor for UnixAcceptor {
    type Io = tokio::net::UnixStream;
    async fn accept(&self) -> std::io::Result<(Self::Io, String)> {
        let (s, _) = self.0.accept().await?;
        let n = self.2.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        Ok((s, format!("{} client {n}", self.1)))
    }
}

/// The connections `listener` accepts; on a TLS listener (`tls`) each one reports a failed
/// handshake.
fn incoming<A: Acceptor>(
    listener: A,
    slots: Arc<Semaphore>,
    idle: Duration,
    tls: bool,
    events: mpsc::Sender<ServerEvent>,
) -> impl tokio_stream::Stream<Item = Result<Conn<A::Io>, std::io::Error>> {
    async_stream::stream! {
        loop {
            let Ok(slot) = slots.clone().acquire_owned().await else { break };
            loop {
                match listener.accept().await {
                    Ok((io, peer)) => {
                        yield Ok(Conn {
                            io,
                            _slot: slot,
                            idle,
                            deadline: Box::pin(tokio::time::sleep(idle)),
                            peer,
                            handshake: tls.then(|| Handshake {
                                done: false.into(),
                                started: std::time::Instant::now(),
                                seen: None,
                                events: events.clone(),
                            }),
                        });
                        break;
                    }
                    Err(e) => {
                        let _ = events.send(ServerEvent::AcceptFailed { error: e.to_string() });
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Server: configuration and entry points.

/// How a server is run.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Precision recipe (reported in `Info`).
    pub recipe: String,
    /// Model (reported in `Info`).
    pub model: String,
    /// A nonce reported in `Info` (a parent recognizes the child it started).
    pub instance: String,
    /// Token required on every call (mandatory on TCP).
    pub token: Option<Token>,
    /// TLS on TCP (mandatory off loopback).
    pub tls: Option<ServerTls>,
    /// Request limits.
    pub limits: Limits,
    /// Connections served at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// Concurrent calls per connection.
    pub max_calls_per_connection: usize,
    /// A connection without a byte from the peer for this long is closed.
    pub idle_timeout: Duration,
}

impl ServerConfig {
    /// Defaults: 64 connections, 8 calls each, 5 minutes idle, no token, no TLS, no nonce.
    pub fn new(recipe: &str, model: &str, limits: Limits) -> ServerConfig {
        ServerConfig {
            recipe: recipe.into(),
            model: model.into(),
            instance: String::new(),
            token: None,
            tls: None,
            limits,
            max_connections: 64,
            max_calls_per_connection: 8,
            idle_timeout: Duration::from_secs(300),
        }
    }
}

enum Listener {
    Unix(std::os::unix::net::UnixListener, PathBuf),
    Tcp(std::net::TcpListener),
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, p) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A handle that stops a running [`RolloutServer::serve`] (as a `Shutdown` call does).
#[derive(Debug, Clone)]
pub struct StopHandle(watch::Sender<bool>);

impl StopHandle {
    /// Ask the server to stop accepting connections and return from `serve`.
    pub fn stop(&self) {
        let _ = self.0.send(true);
    }
}

/// A rollout engine bound to an [`Endpoint`], ready to [`serve`](RolloutServer::serve).
pub struct RolloutServer<P> {
    engine: RolloutEngine<P>,
    listener: Listener,
    endpoint: Endpoint,
    cfg: ServerConfig,
    stop: watch::Sender<bool>,
}

impl<P> std::fmt::Debug for RolloutServer<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RolloutServer({})", self.endpoint)
    }
}

/// Bind a Unix socket owner-only: created inside a fresh 0700 directory, set to 0600, then
/// renamed into place, so no other user can ever connect to it. A stale socket file (no
/// server behind it) is replaced; anything else at the path is an error.
fn bind_unix(path: &Path, ep: &Endpoint) -> Result<std::os::unix::net::UnixListener, ServerError> {
    use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
    use std::os::unix::net::{UnixListener, UnixStream};
    let io = |what: &str, e: std::io::Error| ServerError::Io {
        peer: ep.to_string(),
        what: what.into(),
        msg: e.to_string(),
    };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
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
        std::fs::remove_file(path).map_err(|e| io("remove stale socket", e))?;
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let private = parent.join(format!(".mxrl-sock-{}", std::process::id()));
    let staged = private.join("s");
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&private)
        .map_err(|e| io(&format!("create {}", private.display()), e))?;
    let bound = (|| {
        let l = UnixListener::bind(&staged).map_err(|e| io("bind", e))?;
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| io("chmod 600", e))?;
        std::fs::rename(&staged, path).map_err(|e| io("move the socket into place", e))?;
        Ok(l)
    })();
    let _ = std::fs::remove_file(&staged);
    let _ = std::fs::remove_dir(&private);
    bound
}

impl<P: RolloutPolicy + Send + 'static> RolloutServer<P> {
    /// Listen on `ep` (a TCP port 0 picks a free port; see [`RolloutServer::endpoint`]).
    /// `engine` is served as is: its version and contract hash are the server's. On TCP a
    /// token is required, and TLS unless every address `ep` resolves to is loopback; TLS is
    /// refused on a Unix socket (its file mode protects it).
    pub fn bind(
        ep: &Endpoint,
        engine: RolloutEngine<P>,
        cfg: ServerConfig,
    ) -> Result<Self, ServerError> {
        let io = |what: &str, e: std::io::Error| ServerError::Io {
            peer: ep.to_string(),
            what: what.into(),
            msg: e.to_string(),
        };
        let (listener, endpoint) = match ep {
            Endpoint::Unix(_) if cfg.tls.is_some() => {
                return Err(ServerError::Config {
                    peer: ep.to_string(),
                    msg: "TLS (--tls-cert/--tls-key) is for TCP; a Unix socket is protected by \
                          its owner-only file mode"
                        .into(),
                })
            }
            Endpoint::Unix(p) => (
                Listener::Unix(bind_unix(p, ep)?, p.clone()),
                Endpoint::Unix(p.clone()),
            ),
            Endpoint::Tcp(a) => {
                if cfg.token.is_none() {
                    return Err(ServerError::Config {
                        peer: ep.to_string(),
                        msg: "a TCP rollout server needs a shared secret: pass --token-file \
                              FILE (a file only you can read, at least 16 characters), or \
                              listen on a Unix socket"
                            .into(),
                    });
                }
                let addrs = resolve(ep, a)?;
                if cfg.tls.is_none() && !all_loopback(&addrs) {
                    return Err(ServerError::Config {
                        peer: ep.to_string(),
                        msg: format!(
                            "resolves to {addrs:?}, not only loopback addresses: a server \
                             reachable from the network needs TLS: pass --tls-cert CERT.pem \
                             --tls-key KEY.pem (clients then pass --tls-ca CA.pem), or listen \
                             on 127.0.0.1 or a Unix socket"
                        ),
                    });
                }
                let l = std::net::TcpListener::bind(&addrs[..]).map_err(|e| io("bind", e))?;
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
            engine,
            listener,
            endpoint,
            cfg,
            stop: watch::channel(false).0,
        })
    }

    /// The address clients connect to (with the port a TCP port 0 was given).
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// A handle that stops [`RolloutServer::serve`].
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle(self.stop.clone())
    }

    /// Serve until a `Shutdown` call or the stop handle; `on_event` sees every
    /// [`ServerEvent`] on the calling thread. The engine runs on a thread of its own.
    pub fn serve(self, on_event: &mut dyn FnMut(&ServerEvent)) -> Result<(), ServerError> {
        let RolloutServer {
            engine,
            listener,
            endpoint,
            cfg,
            stop,
        } = self;
        let err = |what: &str, e: String| ServerError::Io {
            peer: endpoint.to_string(),
            what: what.into(),
            msg: e,
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("mxrl-rollout-io")
            .enable_all()
            .build()
            .map_err(|e| err("start the runtime", e.to_string()))?;
        let snap = Arc::new(RwLock::new(snapshot_of(&engine)));
        let contract_hash = engine.contract_hash.clone();
        let (jobs_tx, jobs_rx) = mpsc::channel();
        let engine_snap = snap.clone();
        let engine_thread = std::thread::Builder::new()
            .name("mxrl-rollout-engine".into())
            .spawn(move || engine_loop(engine, jobs_rx, engine_snap))
            .map_err(|e| err("start the engine thread", e.to_string()))?;
        let (ev_tx, ev_rx) = mpsc::channel();
        let inner = Arc::new(Inner {
            jobs: Mutex::new(jobs_tx),
            snap,
            contract_hash,
            events: Mutex::new(ev_tx.clone()),
            update_slot: Arc::new(Semaphore::new(1)),
            stop: stop.clone(),
            cfg,
        });
        let svc = Svc(inner.clone());
        let task = {
            let _guard = rt.enter();
            let slots = Arc::new(Semaphore::new(inner.cfg.max_connections.max(1)));
            let idle = inner.cfg.idle_timeout;
            match &listener {
                Listener::Unix(l, _) => {
                    let l = l
                        .try_clone()
                        .and_then(tokio::net::UnixListener::from_std)
                        .map_err(|e| err("listen", e.to_string()))?;
                    let a = UnixAcceptor(l, endpoint.to_string(), Default::default());
                    rt.spawn(run_grpc(svc, incoming(a, slots, idle, false, ev_tx), stop))
                }
                Listener::Tcp(l) => {
                    let l = l
                        .try_clone()
                        .and_then(tokio::net::TcpListener::from_std)
                        .map_err(|e| err("listen", e.to_string()))?;
                    let tls = inner.cfg.tls.is_some();
                    rt.spawn(run_grpc(svc, incoming(l, slots, idle, tls, ev_tx), stop))
                }
            }
        };
        loop {
            match ev_rx.recv_timeout(Duration::from_millis(50)) {
                Ok(ev) => on_event(&ev),
                Err(mpsc::RecvTimeoutError::Timeout) if task.is_finished() => break,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        let result = rt
            .block_on(task)
            .map_err(|e| err("serve", e.to_string()))
            .and_then(|r| r.map_err(|e| err("serve", e.to_string())));
        while let Ok(ev) = ev_rx.try_recv() {
            on_event(&ev);
        }
        drop(inner);
        rt.shutdown_timeout(Duration::from_secs(5));
        let _ = engine_thread.join();
        drop(listener);
        result
    }
}

/// A service of the router whose oversized request messages are refused with the typed
/// refusal (`RESOURCE_EXHAUSTED`, `LIMIT_EXCEEDED`, the limit's name and value, the served
/// version) instead of the framework's bare status.
///
/// tonic refuses a request message larger than the service's `max_decoding_message_size`
/// from its length prefix, before reading it, with `OUT_OF_RANGE` and no trailer; for a
/// unary or server-streaming call this happens before the handler runs, so the handler cannot
/// type it. The handlers of these services never answer `OUT_OF_RANGE` themselves (every
/// refusal of theirs carries `mxrl-refusal-bin`), so a response whose status — in its
/// headers: a trailers-only response, as tonic answers a request it could not decode — is
/// `OUT_OF_RANGE` without the trailer is exactly that refusal, and is answered again here.
/// (`WeightSync` reads its stream inside the handler, which types the same error itself.)
#[derive(Clone)]
struct TypedOversize<S> {
    inner: S,
    svc: Svc,
    /// The service name for the log (`info`, `generate`, ...).
    request: &'static str,
    /// The limit's name (a field of `Limits` in the `.proto`) and value.
    limit: (&'static str, u64),
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for TypedOversize<S> {
    const NAME: &'static str = S::NAME;
}

type HttpResponse = tonic::codegen::http::Response<tonic::body::Body>;

impl<S, B> tower::Service<tonic::codegen::http::Request<B>> for TypedOversize<S>
where
    S: tower::Service<
        tonic::codegen::http::Request<B>,
        Response = HttpResponse,
        Error = std::convert::Infallible,
    >,
    S::Future: Send + 'static,
{
    type Response = HttpResponse;
    type Error = std::convert::Infallible;
    type Future = tonic::codegen::BoxFuture<HttpResponse, std::convert::Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: tonic::codegen::http::Request<B>) -> Self::Future {
        let peer = peer_in(req.extensions());
        let fut = self.inner.call(req);
        let (svc, request, (name, limit)) = (self.svc.clone(), self.request, self.limit);
        Box::pin(async move {
            let resp = fut.await?;
            match Status::from_header_map(resp.headers()) {
                Some(st)
                    if st.code() == Code::OutOfRange
                        && st.metadata().get_bin(pb::REFUSAL_TRAILER).is_none() =>
                {
                    let r = Refuse::limit(
                        name,
                        limit,
                        format!(
                            "{request}: the request message exceeds the limit {name} = {limit} \
                             bytes ({})",
                            st.message()
                        ),
                    );
                    Ok(svc.refuse(&peer, request, r).into_http())
                }
                _ => Ok(resp),
            }
        })
    }
}

async fn run_grpc<IO, S>(
    svc: Svc,
    incoming: S,
    stop: watch::Sender<bool>,
) -> Result<(), tonic::transport::Error>
where
    S: tokio_stream::Stream<Item = Result<IO, std::io::Error>> + Send + 'static,
    IO: AsyncRead + AsyncWrite + tonic::transport::server::Connected + Unpin + Send + 'static,
{
    let cfg = &svc.0.cfg;
    let token = cfg.token.clone();
    let events = Mutex::new(
        svc.0
            .events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone(),
    );
    let events = Arc::new(events);
    let auth = move |r: Request<()>| -> Result<Request<()>, Status> {
        let Some(t) = &token else { return Ok(r) };
        let ok = r
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|p| t.matches(p.as_bytes()));
        if ok {
            return Ok(r);
        }
        let peer = peer_of(&r);
        let _ = events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(ServerEvent::Unauthenticated { peer });
        Err(Refuse {
            code: Code::Unauthenticated,
            reason: Reason::Unauthenticated,
            msg: "missing or wrong token (metadata `authorization: Bearer <token>`)".into(),
            limit: None,
        }
        .status(0))
    };
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<pb::rollout_server::RolloutServer<Svc>>()
        .await;
    let limits = cfg.limits;
    let calls = cfg.max_calls_per_connection.max(1);
    let mut rx = stop.subscribe();
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &cfg.tls {
        builder = builder.tls_config(tls.config.clone())?;
    }
    let control = TypedOversize {
        inner: pb::rollout_server::RolloutServer::new(svc.clone())
            .max_decoding_message_size(CONTROL_REQUEST_BYTES as usize),
        svc: svc.clone(),
        request: "control call",
        limit: ("max_control_request_bytes", CONTROL_REQUEST_BYTES),
    };
    let sampler = TypedOversize {
        inner: pb::sampler_server::SamplerServer::new(svc.clone())
            .max_decoding_message_size(limits.max_request_bytes as usize),
        svc: svc.clone(),
        request: "generate/score",
        limit: ("max_request_bytes", limits.max_request_bytes),
    };
    builder
        // Weight updates stream in megabytes: windows as large as the client's, so the
        // sender is not held to hyper's 1 MiB default per round trip.
        .initial_stream_window_size(Some(STREAM_WINDOW_BYTES))
        .initial_connection_window_size(Some(CONNECTION_WINDOW_BYTES))
        .max_frame_size(Some(MAX_FRAME_BYTES))
        .concurrency_limit_per_connection(calls)
        .max_concurrent_streams(Some(calls as u32))
        .layer(tonic::service::InterceptorLayer::new(auth))
        .add_service(health)
        .add_service(control)
        .add_service(sampler)
        .add_service(
            pb::weight_sync_server::WeightSyncServer::new(svc).max_decoding_message_size(
                (limits.max_bucket_bytes + BUCKET_FRAMING_BYTES) as usize,
            ),
        )
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = rx.wait_for(|s| *s).await;
        })
        .await
}

// ---------------------------------------------------------------------------------------------
// Client.

#[derive(Clone)]
struct Auth(Option<MetadataValue<Ascii>>);

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut r: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            r.metadata_mut().insert("authorization", v.clone());
        }
        Ok(r)
    }
}

type Chan = tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Auth>;

/// Largest reply message a client accepts (fetched buckets, generated samples).
const CLIENT_MAX_REPLY: usize = 4 << 30;

/// A connection to a rollout server: one blocking method per call (a small runtime of its own
/// drives the gRPC channel).
pub struct RolloutClient {
    endpoint: Endpoint,
    /// TCP without TLS (a transport failure may be a TLS server: said in the error).
    plain_tcp: bool,
    control: pb::rollout_client::RolloutClient<Chan>,
    sampler: pb::sampler_client::SamplerClient<Chan>,
    sync: pb::weight_sync_client::WeightSyncClient<Chan>,
    // Last: the channels above are dropped before the runtime that drives them.
    rt: tokio::runtime::Runtime,
}

impl std::fmt::Debug for RolloutClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RolloutClient({})", self.endpoint)
    }
}

impl RolloutClient {
    /// Connect to the server at `ep` without TLS, sending `token` with every call (needed on
    /// TCP); see [`RolloutClient::connect_tls`].
    pub fn connect(ep: &Endpoint, token: Option<&Token>) -> Result<Self, ServerError> {
        RolloutClient::connect_tls(ep, token, None)
    }

    /// Connect to the server at `ep`, sending `token` with every call (needed on TCP), over
    /// TLS when `tls` is given (TCP only). Without TLS every address `ep` resolves to must be
    /// loopback, so a token never crosses a network in clear.
    pub fn connect_tls(
        ep: &Endpoint,
        token: Option<&Token>,
        tls: Option<&ClientTls>,
    ) -> Result<Self, ServerError> {
        let io = |what: &str, msg: String| ServerError::Io {
            peer: ep.to_string(),
            what: what.into(),
            msg,
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("mxrl-rollout-client")
            .enable_all()
            .build()
            .map_err(|e| io("start the runtime", e.to_string()))?;
        let keep = |e: tonic::transport::Endpoint| {
            e.http2_keep_alive_interval(Duration::from_secs(30))
                .keep_alive_timeout(Duration::from_secs(20))
                .keep_alive_while_idle(true)
                .initial_stream_window_size(Some(STREAM_WINDOW_BYTES))
                .initial_connection_window_size(Some(CONNECTION_WINDOW_BYTES))
        };
        let channel = match ep {
            Endpoint::Unix(_) if tls.is_some() => {
                return Err(ServerError::Config {
                    peer: ep.to_string(),
                    msg: "TLS (--tls-ca) is for TCP; a Unix socket is protected by its \
                          owner-only file mode"
                        .into(),
                })
            }
            Endpoint::Unix(p) => {
                let p = p.clone();
                let e = keep(tonic::transport::Endpoint::from_static("http://localhost"));
                rt.block_on(e.connect_with_connector(tower::service_fn(
                    move |_: tonic::codegen::http::Uri| {
                        let p = p.clone();
                        async move {
                            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                                tokio::net::UnixStream::connect(p).await?,
                            ))
                        }
                    },
                )))
                .map_err(|e| io("connect", transport_msg(&e)))?
            }
            Endpoint::Tcp(a) => {
                let e = match tls {
                    None => {
                        let addrs = resolve(ep, a)?;
                        if !all_loopback(&addrs) {
                            return Err(ServerError::Config {
                                peer: ep.to_string(),
                                msg: format!(
                                    "resolves to {addrs:?}, not only loopback addresses: \
                                     the token would cross the network in clear; pass \
                                     --tls-ca CA.pem (the authority that signed the \
                                     server's --tls-cert), or connect through an SSH tunnel \
                                     to 127.0.0.1"
                                ),
                            });
                        }
                        tonic::transport::Endpoint::from_shared(format!("http://{a}"))
                            .map_err(|e| io("connect", e.to_string()))?
                    }
                    Some(t) => tonic::transport::Endpoint::from_shared(format!("https://{a}"))
                        .and_then(|e| e.tls_config(t.config(tcp_host(a))))
                        .map_err(|e| io("TLS configuration", transport_msg(&e)))?,
                };
                rt.block_on(keep(e).tcp_nodelay(true).connect())
                    .map_err(|e| io("connect", transport_msg(&e)))?
            }
        };
        let auth = Auth(token.map(Token::header));
        Ok(RolloutClient {
            endpoint: ep.clone(),
            plain_tcp: matches!(ep, Endpoint::Tcp(_)) && tls.is_none(),
            control: pb::rollout_client::RolloutClient::with_interceptor(
                channel.clone(),
                auth.clone(),
            )
            .max_decoding_message_size(CLIENT_MAX_REPLY),
            sampler: pb::sampler_client::SamplerClient::with_interceptor(
                channel.clone(),
                auth.clone(),
            )
            .max_decoding_message_size(CLIENT_MAX_REPLY),
            sync: pb::weight_sync_client::WeightSyncClient::with_interceptor(channel, auth)
                .max_decoding_message_size(CLIENT_MAX_REPLY),
            rt,
        })
    }

    /// The server's address.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    fn peer(&self) -> String {
        self.endpoint.to_string()
    }

    fn remote(&self, request: &str, s: Status) -> ServerError {
        let refusal = s
            .metadata()
            .get_bin(pb::REFUSAL_TRAILER)
            .and_then(|v| v.to_bytes().ok())
            .and_then(|b| pb::Refusal::decode(b).ok())
            .map(Box::new);
        let mut msg = s.message().to_string();
        if refusal.is_none() {
            // A transport failure: its causes, and the likeliest one on plain TCP.
            msg = with_causes(msg, std::error::Error::source(&s));
            if self.plain_tcp
                && matches!(s.code(), Code::Unknown | Code::Unavailable | Code::Internal)
            {
                msg.push_str(" (if the server serves TLS, pass --tls-ca CA.pem)");
            }
        }
        ServerError::Remote {
            peer: self.peer(),
            request: request.into(),
            code: s.code(),
            msg,
            refusal,
        }
    }

    fn protocol(&self, msg: String) -> ServerError {
        ServerError::Protocol {
            peer: self.peer(),
            msg,
        }
    }

    /// The server's version, contract, recipe, model, nonce and limits.
    pub fn info(&mut self) -> Result<ServerInfo, ServerError> {
        let r = self
            .rt
            .block_on(self.control.info(pb::InfoRequest {}))
            .map_err(|s| self.remote("info", s))?
            .into_inner();
        let limits = r.limits.unwrap_or_default();
        Ok(ServerInfo {
            protocol: r.protocol,
            version: r.version,
            contract_hash: r.contract_hash,
            recipe: r.recipe,
            model: r.model,
            tensors: usize_of(r.tensors, "tensor count").map_err(|m| self.protocol(m))?,
            weight_bytes: r.weight_bytes,
            instance: r.instance,
            max_bucket_bytes: limits.max_bucket_bytes,
        })
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
        let req = pb::GenerateRequest {
            prompts: prompts
                .iter()
                .map(|p| pb::TokenIds { ids: p.clone() })
                .collect(),
            n: n as u64,
            sampling: Some(pb::SamplingConfig {
                temperature: cfg.temperature,
                top_p: cfg.top_p,
                max_new_tokens: cfg.max_new_tokens as u64,
            }),
            eos,
            seed,
        };
        let r = self
            .rt
            .block_on(self.sampler.generate(req))
            .map_err(|s| self.remote("generate", s))?
            .into_inner();
        if r.samples.len() != prompts.len() * n {
            return Err(self.protocol(format!(
                "generate: expected {} samples ({} prompts × {n}), got {}",
                prompts.len() * n,
                prompts.len(),
                r.samples.len()
            )));
        }
        let samples = r
            .samples
            .into_iter()
            .map(sample_from_proto)
            .collect::<Result<_, _>>()
            .map_err(|m| self.protocol(format!("generate reply: {m}")))?;
        Ok((r.version, samples))
    }

    /// Score on the server (bitwise mode); returns the version and one logprob list per
    /// sequence.
    pub fn score(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<(u64, Vec<Vec<f32>>), ServerError> {
        let req = pb::ScoreRequest {
            temperature,
            sequences: batch
                .iter()
                .map(|s| pb::ScoreSequence {
                    prompt: s.prompt.to_vec(),
                    response: s.response.to_vec(),
                    replay: s.replay.map(trace_to_proto),
                })
                .collect(),
        };
        self.score_raw(req)
    }

    /// Send a score request as it is (tests send malformed ones).
    pub fn score_raw(
        &mut self,
        req: pb::ScoreRequest,
    ) -> Result<(u64, Vec<Vec<f32>>), ServerError> {
        let n = req.sequences.len();
        let r = self
            .rt
            .block_on(self.sampler.score(req))
            .map_err(|s| self.remote("score", s))?
            .into_inner();
        if r.logprobs.len() != n {
            return Err(self.protocol(format!(
                "score: expected {n} logprob lists, got {}",
                r.logprobs.len()
            )));
        }
        Ok((
            r.version,
            r.logprobs.into_iter().map(|l| l.values).collect(),
        ))
    }

    /// Send a generate request as it is (tests send malformed ones).
    pub fn generate_raw(&mut self, req: pb::GenerateRequest) -> Result<u64, ServerError> {
        Ok(self
            .rt
            .block_on(self.sampler.generate(req))
            .map_err(|s| self.remote("generate", s))?
            .into_inner()
            .version)
    }

    /// SHA-256 digests of the weights the server holds.
    pub fn digest(&mut self) -> Result<WeightsDigest, ServerError> {
        let r = self
            .rt
            .block_on(self.control.digest(pb::DigestRequest {}))
            .map_err(|s| self.remote("weight digest", s))?
            .into_inner();
        let tensors = r
            .tensors
            .into_iter()
            .map(|t| {
                Ok(TensorDigest {
                    format: format_from_proto(t.format)
                        .ok_or_else(|| format!("tensor {}: format code {}", t.name, t.format))?,
                    shape: t
                        .shape
                        .iter()
                        .map(|&d| usize_of(d, "dimension"))
                        .collect::<Result<_, _>>()?,
                    data: hex(&t.data_sha256),
                    scales: hex(&t.scales_sha256),
                    amax: hex(&t.amax_sha256),
                    name: t.name,
                })
            })
            .collect::<Result<_, String>>()
            .map_err(|m| self.protocol(format!("digest reply: {m}")))?;
        Ok(WeightsDigest {
            version: r.version,
            tensors,
        })
    }

    /// The weights the server holds, byte for byte, and their version (every bucket's
    /// SHA-256 verified).
    pub fn fetch(&mut self) -> Result<(u64, Vec<WireTensor>), ServerError> {
        use pb::update_message::Kind;
        let peer = self.peer();
        let mut s = self
            .rt
            .block_on(self.control.fetch(pb::FetchRequest { bucket_bytes: 0 }))
            .map_err(|s| self.remote("weight fetch", s))?
            .into_inner();
        let proto = |msg: String| ServerError::Protocol {
            peer: peer.clone(),
            msg: format!("weight fetch: {msg}"),
        };
        let mut asm: Option<UpdateAssembler> = None;
        loop {
            let m = self
                .rt
                .block_on(s.message())
                .map_err(|st| self.remote("weight fetch", st))?;
            match m.and_then(|m| m.kind) {
                Some(Kind::Header(h)) if asm.is_none() => {
                    let header = UpdateHeader {
                        version: h.version,
                        contract_hash: h.contract_hash.clone(),
                        buckets: h.buckets,
                        tensors: h.tensors,
                        bytes: h.bytes,
                    };
                    asm = Some(
                        UpdateAssembler::begin(header, &h.contract_hash)
                            .map_err(|e| proto(e.to_string()))?,
                    );
                }
                Some(Kind::Bucket(b)) => {
                    let a = asm
                        .as_mut()
                        .ok_or_else(|| proto("bucket before header".into()))?;
                    let checksum = b
                        .sha256
                        .as_slice()
                        .try_into()
                        .map_err(|_| proto("checksum of the wrong length".into()))?;
                    a.add(&Bucket {
                        index: b.index,
                        checksum,
                        payload: b.payload,
                    })
                    .map_err(|e| proto(e.to_string()))?;
                }
                Some(Kind::Commit(_)) => break,
                other => return Err(proto(format!("unexpected message {other:?}"))),
            }
        }
        asm.ok_or_else(|| proto("no header".into()))?
            .finish()
            .map_err(|e| proto(e.to_string()))
    }

    /// Send a complete weight update and wait for the server's reply (the version it now
    /// serves). A refused update is [`ServerError::Refused`] (the server serves its previous
    /// version, named in the error).
    pub fn update(&mut self, u: WeightUpdate) -> Result<u64, ServerError> {
        let version = u.header.version;
        self.update_messages(version, update_messages(u).collect())
    }

    /// Send update messages as they are (tests send malformed streams); `version` names the
    /// update in errors.
    pub fn update_messages(
        &mut self,
        version: u64,
        msgs: Vec<pb::UpdateMessage>,
    ) -> Result<u64, ServerError> {
        let r = self
            .rt
            .block_on(self.sync.update_weights(tokio_stream::iter(msgs)));
        match r {
            Ok(r) => Ok(r.into_inner().version),
            Err(s) => match self.remote(&format!("weight update v{version}"), s) {
                ServerError::Remote {
                    refusal: Some(refusal),
                    msg,
                    peer,
                    ..
                } => Err(ServerError::Refused {
                    peer,
                    version,
                    serving: refusal.serving_version,
                    reason: refusal.reason(),
                    msg,
                }),
                other => Err(other),
            },
        }
    }

    /// Ask the server to stop; it finishes the calls in flight and stops accepting.
    pub fn shutdown(&mut self) -> Result<(), ServerError> {
        self.rt
            .block_on(self.control.shutdown(pb::ShutdownRequest {}))
            .map_err(|s| self.remote("shutdown", s))?;
        Ok(())
    }
}

/// A transport error with its causes (tonic's top-level message alone says "transport error").
fn transport_msg(e: &dyn std::error::Error) -> String {
    with_causes(e.to_string(), e.source())
}

/// `msg` followed by every cause in `src`'s chain that it does not already say.
fn with_causes(mut msg: String, mut src: Option<&dyn std::error::Error>) -> String {
    while let Some(s) = src {
        let t = s.to_string();
        if !msg.contains(&t) {
            msg.push_str(": ");
            msg.push_str(&t);
        }
        src = s.source();
    }
    msg
}

/// A [`RolloutPolicy`] whose weights and sampling live in a rollout server.
///
/// `load_weights_versioned` (called by the rollout engine of [`crate::runner::RlRun`]) sends
/// a full, versioned, checksummed update and waits for the server's reply; a refused or
/// broken update is an error and leaves the server on its previous version.
#[derive(Debug)]
pub struct RemoteRollout {
    client: Mutex<RolloutClient>,
    info: ServerInfo,
    contract_hash: String,
    /// Bucket size of the updates it sends (bytes; at most the server's limit).
    pub bucket_bytes: usize,
    version: u64,
}

impl RemoteRollout {
    /// Connect to `ep` without TLS and check that the server speaks this protocol and uses
    /// the quantizer contract `contract_hash`; see [`RemoteRollout::connect_tls`].
    pub fn connect(
        ep: &Endpoint,
        contract_hash: &str,
        token: Option<&Token>,
    ) -> Result<Self, ServerError> {
        RemoteRollout::connect_tls(ep, contract_hash, token, None)
    }

    /// Connect to `ep` (over TLS when `tls` is given, see [`RolloutClient::connect_tls`]) and
    /// check that the server speaks this protocol and uses the quantizer contract
    /// `contract_hash`.
    pub fn connect_tls(
        ep: &Endpoint,
        contract_hash: &str,
        token: Option<&Token>,
        tls: Option<&ClientTls>,
    ) -> Result<Self, ServerError> {
        let mut c = RolloutClient::connect_tls(ep, token, tls)?;
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
            contract_hash: contract_hash.into(),
            bucket_bytes: (1 << 20).min(info.max_bucket_bytes.max(1) as usize),
            info,
        })
    }

    /// What the server said when this client connected.
    pub fn info(&self) -> &ServerInfo {
        &self.info
    }

    /// Set the bucket size of updates, clipped to the server's limit.
    pub fn set_bucket_bytes(&mut self, bytes: usize) {
        self.bucket_bytes = bytes.clamp(1, self.info.max_bucket_bytes.max(1) as usize);
    }

    /// The last version the server confirmed.
    pub fn version(&self) -> u64 {
        self.version
    }

    fn client(&self) -> MutexGuard<'_, RolloutClient> {
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

    /// Sends update `u` and records its version once the server acknowledged it.
    fn send(&mut self, u: WeightUpdate) -> Result<(), PolicyError> {
        let version = u.header.version;
        let v = self
            .client()
            .update(u)
            .map_err(|e| PolicyError::Update(e.to_string()))?;
        if v != version {
            return Err(PolicyError::Update(format!(
                "rollout server {}: acknowledged v{v} for update v{version}",
                self.info.model
            )));
        }
        self.version = version;
        Ok(())
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
        self.send(WeightUpdate::build(
            version,
            &self.contract_hash,
            tensors,
            self.bucket_bytes,
        ))
    }

    /// Sends the buckets as they are (sharing their payloads, not copying them); the server
    /// verifies every checksum and applies the update atomically. An update with a bucket
    /// larger than the server takes is left to the rollout engine (`None`), which verifies and
    /// decodes it and sends its tensors in buckets of [`RemoteRollout::bucket_bytes`].
    fn load_update(&mut self, update: &WeightUpdate) -> Option<Result<(), PolicyError>> {
        let max = self.info.max_bucket_bytes;
        if update.buckets.iter().any(|b| b.payload.len() as u64 > max) {
            return None;
        }
        Some(self.send(update.clone()))
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

    const SHAPE: ModelShape = ModelShape {
        vocab_size: 64,
        moe_layers: 0,
        top_k: 0,
        num_experts: 0,
        max_positions: 4096,
    };

    struct Running {
        at: Endpoint,
        rx: mpsc::Receiver<ServerEvent>,
        h: std::thread::JoinHandle<()>,
        stop: StopHandle,
    }

    /// Start a server for `policy` on `ep` in a thread.
    fn start<P: RolloutPolicy + Send + 'static>(
        ep: &Endpoint,
        policy: P,
        contract: &str,
        tune: impl FnOnce(&mut ServerConfig),
    ) -> Running {
        let limits = Limits::for_model(SHAPE, &policy.weights());
        let mut cfg = ServerConfig::new("bf16", "t", limits);
        tune(&mut cfg);
        let srv = RolloutServer::bind(ep, RolloutEngine::new(policy, 0, contract), cfg).unwrap();
        let at = srv.endpoint().clone();
        let stop = srv.stop_handle();
        let (tx, rx) = mpsc::channel();
        let h = std::thread::spawn(move || {
            srv.serve(&mut |e| {
                let _ = tx.send(e.clone());
            })
            .unwrap();
        });
        Running { at, rx, h, stop }
    }

    fn until(
        rx: &mpsc::Receiver<ServerEvent>,
        mut stop: impl FnMut(&ServerEvent) -> bool,
    ) -> Vec<ServerEvent> {
        let mut out = Vec::new();
        loop {
            let e = rx
                .recv_timeout(Duration::from_secs(20))
                .unwrap_or_else(|_| panic!("no matching server event; saw {out:?}"));
            let done = stop(&e);
            out.push(e);
            if done {
                return out;
            }
        }
    }

    fn reason(e: &ServerError) -> Reason {
        e.refusal()
            .unwrap_or_else(|| panic!("no typed refusal in {e}"))
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

    /// Binding a Unix socket path replaces only a stale socket file (nobody listening); a
    /// regular file, a directory, a symlink (even to a stale socket) and a live server's socket
    /// are refused, naming the path and why, and left as they were.
    #[test]
    fn a_unix_socket_path_replaces_only_a_stale_socket() {
        use std::os::unix::fs::FileTypeExt;
        let dir = tempfile::tempdir().unwrap();
        let bind = |p: &Path| {
            let t = trainer(0.0, Format::Bf16);
            let limits = Limits::for_model(SHAPE, &t.rollout().unwrap().weights());
            let engine = RolloutEngine::new(t.rollout().unwrap(), 0, "h");
            RolloutServer::bind(
                &Endpoint::Unix(p.into()),
                engine,
                ServerConfig::new("bf16", "t", limits),
            )
        };
        let is_socket = |p: &Path| {
            std::fs::symlink_metadata(p)
                .unwrap()
                .file_type()
                .is_socket()
        };
        let stale = dir.path().join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
        assert!(is_socket(&stale));

        let file = dir.path().join("file.sock");
        std::fs::write(&file, "keep me").unwrap();
        let sub = dir.path().join("dir.sock");
        std::fs::create_dir(&sub).unwrap();
        let link = dir.path().join("link.sock");
        std::os::unix::fs::symlink(&stale, &link).unwrap();
        for p in [&file, &sub, &link] {
            let e = bind(p).unwrap_err().to_string();
            assert!(
                e.contains("not a socket") && e.contains(&p.display().to_string()),
                "{e}"
            );
        }
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
        assert!(sub.is_dir());
        assert_eq!(std::fs::read_link(&link).unwrap(), stale);
        assert!(is_socket(&stale));

        // The stale socket is replaced by a live one; a second server is refused there.
        let srv = bind(&stale).unwrap();
        assert!(is_socket(&stale));
        std::os::unix::net::UnixStream::connect(&stale).unwrap();
        let e = bind(&stale).unwrap_err().to_string();
        assert!(e.contains("another server is listening there"), "{e}");
        // The server removes its socket when it goes away (and nothing else).
        drop(srv);
        assert!(!stale.exists());
        assert!(file.exists() && sub.is_dir() && link.symlink_metadata().is_ok());
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".mxrl-sock-"))
            .collect();
        assert!(left.is_empty(), "staging directories left: {left:?}");
    }

    #[test]
    fn remote_policy_matches_the_local_policy_and_shuts_down() {
        let dir = tempfile::tempdir().unwrap();
        let token = Token::new("0123456789abcdef-test").unwrap();
        for ep in [
            Endpoint::Unix(dir.path().join("r.sock")),
            Endpoint::Tcp("127.0.0.1:0".into()),
        ] {
            let t0 = trainer(0.0, Format::Mxfp8);
            let mut local = t0.rollout().unwrap();
            let tok = token.clone();
            let srv = start(&ep, t0.rollout().unwrap(), "h", |c| c.token = Some(tok));
            let mut remote = RemoteRollout::connect(&srv.at, "h", Some(&token)).unwrap();
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
                .filter(|s| !s.response.is_empty())
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
            srv.h.join().unwrap();
            let evs: Vec<ServerEvent> = srv.rx.try_iter().collect();
            let applied: Vec<u64> = evs
                .iter()
                .filter_map(|e| match e {
                    ServerEvent::Applied { version, .. } => Some(*version),
                    _ => None,
                })
                .collect();
            assert_eq!(applied, [4, 5]);
            assert!(
                evs.iter()
                    .any(|e| matches!(e, ServerEvent::Shutdown { .. })),
                "{evs:?}"
            );
            if let Endpoint::Unix(p) = &srv.at {
                assert!(!p.exists(), "socket file left behind");
            }
        }
    }

    /// Every refusal of an update is typed, carries the served version, changes nothing and
    /// leaves the connection usable; a stream cut before its commit changes nothing either.
    /// A bucket corrupted in transit (one byte of its last tensor flipped, the checksum the
    /// sender computed kept), sent the way the RL loop sends updates (a rollout engine over
    /// [`RemoteRollout`]): refused as a checksum failure naming the bucket and the tensors it
    /// carries; the server keeps serving the old version and the old bytes (its digest), the
    /// intact update then applies, and the digest computed on demand after it is the new
    /// bytes'.
    #[test]
    fn a_corrupted_bucket_is_refused_naming_its_tensors_and_the_old_weights_keep_serving() {
        let dir = tempfile::tempdir().unwrap();
        let ep = Endpoint::Unix(dir.path().join("c.sock"));
        let t0 = trainer(0.0, Format::Mxfp8);
        let before = t0.export_weights().unwrap();
        let srv = start(&ep, t0.rollout().unwrap(), "h", |_| {});
        let ex = trainer(2.0, Format::Mxfp8).export_weights().unwrap();
        assert!(check_digests(
            "t",
            &RolloutClient::connect(&srv.at, None)
                .unwrap()
                .digest()
                .unwrap(),
            &ex
        )
        .is_err());
        let mut eng =
            RolloutEngine::new(RemoteRollout::connect(&srv.at, "h", None).unwrap(), 0, "h");
        let mut u = WeightUpdate::build(1, "h", &ex, 64);
        let last = u.buckets.len() - 1;
        let names: Vec<String> = sync::decode_tensors(&u.buckets[last].payload)
            .unwrap()
            .into_iter()
            .map(|t| t.name)
            .collect();
        let mut p = u.buckets[last].payload.to_vec();
        *p.last_mut().unwrap() ^= 0x10;
        u.buckets[last].payload = p.into();
        let e = eng.apply(&u).unwrap_err().to_string();
        assert!(
            e.contains(&format!("bucket {last}")) && e.contains("SHA-256") && e.contains(&names[0]),
            "{e}"
        );
        assert_eq!(eng.version, 0);
        let mut c = RolloutClient::connect(&srv.at, None).unwrap();
        assert_eq!(c.info().unwrap().version, 0);
        eng.check(&before).unwrap();
        let rep = eng.apply(&WeightUpdate::build(1, "h", &ex, 64)).unwrap();
        assert_eq!(rep.version, 1);
        eng.check(&ex).unwrap();
        assert!(eng.check(&before).is_err());
        until(&srv.rx, |e| {
            matches!(e, ServerEvent::Applied { version: 1, .. })
        });
        srv.stop.stop();
        srv.h.join().unwrap();
    }

    #[test]
    fn refused_and_dropped_updates_change_nothing_and_are_typed() {
        use pb::update_message::Kind;
        let dir = tempfile::tempdir().unwrap();
        let ep = Endpoint::Unix(dir.path().join("u.sock"));
        let t0 = trainer(0.0, Format::Nvfp4);
        let before = t0.export_weights().unwrap();
        let srv = start(&ep, t0.rollout().unwrap(), "contract-a", |_| {});
        let ex = trainer(2.0, Format::Nvfp4).export_weights().unwrap();
        {
            use std::os::unix::fs::PermissionsExt;
            let Endpoint::Unix(p) = &srv.at else {
                unreachable!()
            };
            let mode = std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "socket mode {mode:o}");
        }

        let e = RemoteRollout::connect(&srv.at, "contract-b", None).unwrap_err();
        assert!(matches!(e, ServerError::Contract { .. }), "{e}");

        let mut c = RolloutClient::connect(&srv.at, None).unwrap();
        let e = c
            .update(WeightUpdate::build(1, "contract-b", &ex, 64))
            .unwrap_err();
        assert_eq!(reason(&e), Reason::ContractMismatch);
        assert!(e.to_string().contains("contract-b") && e.to_string().contains("contract-a"));

        let mut bad = WeightUpdate::build(1, "contract-a", &ex, 64);
        let mut p = bad.buckets[0].payload.to_vec();
        p[3] ^= 1;
        bad.buckets[0].payload = p.into();
        let e = c.update(bad).unwrap_err();
        assert_eq!(reason(&e), Reason::BadChecksum);
        assert!(e.to_string().contains("bucket 0"), "{e}");

        // Absurd counts in a header: refused before anything is allocated.
        let u = WeightUpdate::build(1, "contract-a", &ex, 64);
        let header = |buckets, tensors, bytes| pb::UpdateMessage {
            kind: Some(Kind::Header(pb::UpdateHeader {
                version: 1,
                contract_hash: "contract-a".into(),
                buckets,
                tensors,
                bytes,
            })),
        };
        for (h, want) in [
            (header(u32::MAX, 1, 100), Reason::BadUpdate),
            (header(1, u32::MAX, 100), Reason::LimitExceeded),
            (header(1, 1, 1 << 60), Reason::LimitExceeded),
        ] {
            let e = c.update_messages(1, vec![h]).unwrap_err();
            assert_eq!(reason(&e), want, "{e}");
        }
        // A stream that ends before its commit; then one whose commit names another version.
        let mut msgs: Vec<_> = update_messages(u.clone()).collect();
        let commit = msgs.pop().unwrap();
        let e = c.update_messages(1, msgs.clone()).unwrap_err();
        assert_eq!(reason(&e), Reason::Incomplete);
        msgs.push(pb::UpdateMessage {
            kind: Some(Kind::Commit(pb::Commit { version: 9 })),
        });
        assert_eq!(
            reason(&c.update_messages(1, msgs).unwrap_err()),
            Reason::BadUpdate
        );
        drop(commit);

        // A client that goes away in the middle of an update: the stream breaks, nothing
        // changes.
        let rt = tokio::runtime::Runtime::new().unwrap();
        let Endpoint::Unix(p) = srv.at.clone() else {
            unreachable!()
        };
        rt.block_on(async {
            let ch = tonic::transport::Endpoint::from_static("http://localhost")
                .connect_with_connector(tower::service_fn(move |_: tonic::codegen::http::Uri| {
                    let p = p.clone();
                    async move {
                        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                            tokio::net::UnixStream::connect(p).await?,
                        ))
                    }
                }))
                .await
                .unwrap();
            let mut raw = pb::weight_sync_client::WeightSyncClient::new(ch);
            let first: Vec<_> = update_messages(u.clone()).take(2).collect();
            let s =
                tokio_stream::StreamExt::chain(tokio_stream::iter(first), tokio_stream::pending());
            let r = tokio::time::timeout(Duration::from_millis(500), raw.update_weights(s)).await;
            assert!(
                r.is_err(),
                "the update should still be waiting for its commit"
            );
        });
        drop(rt);
        // The client's end of the stream closes (or resets) without a commit: the server
        // logs it as an incomplete or dropped update, still on version 0.
        let cut = |e: &ServerEvent| match e {
            ServerEvent::Dropped { peer, .. } | ServerEvent::Refused { peer, .. } => {
                peer.ends_with("client 3")
            }
            _ => false,
        };
        let evs = until(&srv.rx, cut);
        match evs.last().unwrap() {
            ServerEvent::Dropped { serving, error, .. }
            | ServerEvent::Refused { serving, error, .. } => {
                assert_eq!(*serving, 0);
                assert!(error.contains("before its commit"), "{error}");
            }
            e => unreachable!("{e:?}"),
        }
        let (v, w) = c.fetch().unwrap();
        assert_eq!(v, 0);
        sync::check_equal(&w, &before).unwrap();
        assert_eq!(c.update(u.clone()).unwrap(), 1);
        let (v, w) = c.fetch().unwrap();
        assert_eq!(v, 1);
        sync::check_equal(&w, &ex).unwrap();
        let e = c.update(u).unwrap_err();
        assert!(
            matches!(
                e,
                ServerError::Refused {
                    version: 1,
                    serving: 1,
                    reason: Reason::StaleVersion,
                    ..
                }
            ),
            "{e}"
        );
        c.shutdown().unwrap();
        srv.h.join().unwrap();
    }

    /// Generate and score requests beyond the limits or not fitting the model are refused
    /// with typed errors before the engine sees them; the connection stays usable.
    #[test]
    fn limits_and_malformed_requests_are_refused_and_the_server_keeps_serving() {
        let dir = tempfile::tempdir().unwrap();
        let ep = Endpoint::Unix(dir.path().join("l.sock"));
        let srv = start(
            &ep,
            trainer(0.0, Format::Bf16).rollout().unwrap(),
            "h",
            |c| {
                c.limits.max_request_bytes = 4096;
                c.limits.max_sequence_length = 32;
                c.limits.max_new_tokens = 16;
                c.limits.max_sequences = 64;
            },
        );
        let mut c = RolloutClient::connect(&srv.at, None).unwrap();
        let gen = |prompts: Vec<Vec<u32>>, n: u64, max_new: u64, eos: u32| pb::GenerateRequest {
            prompts: prompts
                .into_iter()
                .map(|ids| pb::TokenIds { ids })
                .collect(),
            n,
            sampling: Some(pb::SamplingConfig {
                temperature: 1.0,
                top_p: 1.0,
                max_new_tokens: max_new,
            }),
            eos,
            seed: 1,
        };
        let cases = [
            (
                gen(vec![vec![1]], 1 << 40, 4, 0),
                Reason::LimitExceeded,
                "max_sequences",
            ),
            (
                gen(vec![vec![1]], 1, 1 << 40, 0),
                Reason::LimitExceeded,
                "max_new_tokens",
            ),
            (
                gen(vec![vec![1; 30]], 1, 8, 0),
                Reason::LimitExceeded,
                "max_sequence_length",
            ),
            (gen(vec![vec![64]], 1, 4, 0), Reason::InvalidRequest, ""),
            (gen(vec![vec![1]], 1, 4, 99), Reason::InvalidRequest, ""),
            (gen(vec![vec![]], 1, 4, 0), Reason::InvalidRequest, ""),
        ];
        for (req, want, limit) in cases {
            let e = c.generate_raw(req).unwrap_err();
            assert_eq!(reason(&e), want, "{e}");
            if let ServerError::Remote {
                refusal: Some(r), ..
            } = &e
            {
                assert_eq!(r.limit_name, limit, "{e}");
                assert_eq!(r.serving_version, 0);
            }
        }
        let mut bad_t = gen(vec![vec![1]], 1, 4, 0);
        bad_t.sampling.as_mut().unwrap().temperature = f32::NAN;
        assert_eq!(
            reason(&c.generate_raw(bad_t).unwrap_err()),
            Reason::InvalidRequest
        );
        // A message over the sampler's size limit is refused from its length prefix, typed:
        // the limit's name and value and the served version.
        let e = c
            .generate_raw(gen(vec![vec![1; 5000]], 1, 4, 0))
            .unwrap_err();
        let ServerError::Remote {
            code,
            refusal: Some(r),
            ..
        } = &e
        else {
            panic!("no typed refusal: {e}")
        };
        assert_eq!(*code, Code::ResourceExhausted, "{e}");
        assert_eq!(r.reason(), Reason::LimitExceeded, "{e}");
        assert_eq!(
            (r.limit_name.as_str(), r.limit),
            ("max_request_bytes", 4096)
        );
        assert_eq!(r.serving_version, 0);
        assert!(e.to_string().contains("max_request_bytes = 4096"), "{e}");
        // So is a control request over its 1 KiB: an Info call carrying 2 KiB (sent as another
        // message type on the Info path; the server reads none of it).
        let Endpoint::Unix(sock) = srv.at.clone() else {
            unreachable!()
        };
        let rt = tokio::runtime::Runtime::new().unwrap();
        let st = rt.block_on(async move {
            let ch = tonic::transport::Endpoint::from_static("http://localhost")
                .connect_with_connector(tower::service_fn(move |_: tonic::codegen::http::Uri| {
                    let p = sock.clone();
                    async move {
                        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                            tokio::net::UnixStream::connect(p).await?,
                        ))
                    }
                }))
                .await
                .unwrap();
            let mut g = tonic::client::Grpc::new(ch);
            g.ready().await.unwrap();
            let big = pb::TokenIds { ids: vec![1; 2048] };
            g.unary::<_, pb::InfoReply, _>(
                Request::new(big),
                tonic::codegen::http::uri::PathAndQuery::from_static(
                    "/mxrl.rollout.v1.Rollout/Info",
                ),
                tonic_prost::ProstCodec::default(),
            )
            .await
            .unwrap_err()
        });
        drop(rt);
        let e = c.remote("info", st);
        assert_eq!(reason(&e), Reason::LimitExceeded, "{e}");
        let ServerError::Remote {
            refusal: Some(r), ..
        } = &e
        else {
            unreachable!()
        };
        assert_eq!(
            (r.limit_name.as_str(), r.limit),
            ("max_control_request_bytes", CONTROL_REQUEST_BYTES)
        );
        // A routing trace for this dense model is refused.
        let e = c
            .score_raw(pb::ScoreRequest {
                temperature: 1.0,
                sequences: vec![pb::ScoreSequence {
                    prompt: vec![1],
                    response: vec![2],
                    replay: Some(pb::RoutingTrace::default()),
                }],
            })
            .unwrap_err();
        assert_eq!(reason(&e), Reason::InvalidRequest);
        // Still serving, same connection.
        assert_eq!(c.info().unwrap().version, 0);
        let (_, s) = c
            .generate(
                &[vec![1, 2]],
                2,
                &SamplingConfig {
                    temperature: 1.0,
                    top_p: 1.0,
                    max_new_tokens: 4,
                },
                0,
                3,
            )
            .unwrap();
        assert_eq!(s.len(), 2);
        srv.stop.stop();
        srv.h.join().unwrap();
    }

    #[test]
    fn routing_traces_must_fit_the_model() {
        let mut l = Limits::for_model(
            ModelShape {
                vocab_size: 10,
                moe_layers: 2,
                top_k: 2,
                num_experts: 4,
                max_positions: 4096,
            },
            &[],
        );
        l.max_sequence_length = 100;
        let seq = |trace: pb::RoutingTrace| pb::ScoreRequest {
            temperature: 1.0,
            sequences: vec![pb::ScoreSequence {
                prompt: vec![1, 2],
                response: vec![3, 4],
                replay: Some(trace),
            }],
        };
        // 3 positions (prompt + response - 1) × 2 layers × top-2 = 12 entries.
        let good = pb::RoutingTrace {
            layers: 2,
            top_k: 2,
            ids: vec![0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3],
            weights: vec![0.5; 12],
        };
        let (_, s) = check_score(&l, seq(good.clone())).unwrap();
        assert_eq!(s[0].replay.as_ref().unwrap().num_tokens(), 3);
        let mut short = good.clone();
        short.ids.truncate(8);
        short.weights.truncate(8);
        let mut layers = good.clone();
        layers.layers = 3;
        let mut expert = good.clone();
        expert.ids[5] = 4;
        let mut nan = good.clone();
        nan.weights[0] = f32::NAN;
        let mut ragged = good.clone();
        ragged.weights.pop();
        for (t, what) in [
            (short, "expected 12"),
            (layers, "3 layers"),
            (expert, "expert 4"),
            (nan, "non-finite"),
            (ragged, "11 weights"),
        ] {
            let e = check_score(&l, seq(t)).err().expect("refused");
            assert_eq!(e.reason, Reason::InvalidRequest);
            assert!(e.msg.contains(what), "{}", e.msg);
        }
        // Some sequences with a trace and some without: refused.
        let mut mixed = seq(good);
        mixed.sequences.push(pb::ScoreSequence {
            prompt: vec![1],
            response: vec![2],
            replay: None,
        });
        assert!(check_score(&l, mixed)
            .err()
            .unwrap()
            .msg
            .contains("all or none"));
    }

    /// A policy that blocks in `generate` until released and panics on `eos == 63`.
    struct Gate {
        inner: crate::tabular::TabularRollout,
        entered: mpsc::Sender<()>,
        release: Arc<Mutex<mpsc::Receiver<()>>>,
    }

    impl RolloutPolicy for Gate {
        fn generate(
            &mut self,
            prompts: &[Vec<u32>],
            n: usize,
            cfg: &SamplingConfig,
            eos: u32,
            seed: u64,
        ) -> Result<Vec<Sample>, PolicyError> {
            if eos == 63 {
                panic!("a bug in the policy");
            }
            if eos == 62 {
                let _ = self.entered.send(());
                let _ = self.release.lock().unwrap().recv();
            }
            self.inner.generate(prompts, n, cfg, eos, seed)
        }
        fn load_weights(&mut self, t: &[WireTensor]) -> Result<(), PolicyError> {
            self.inner.load_weights(t)
        }
        fn weights(&self) -> Vec<WireTensor> {
            self.inner.weights()
        }
        fn score(&mut self, b: &[TrainSeq<'_>], t: f32) -> Result<Vec<Vec<f32>>, PolicyError> {
            self.inner.score(b, t)
        }
    }

    #[test]
    fn a_panic_is_an_error_and_a_long_generation_does_not_block_info_or_digest() {
        let dir = tempfile::tempdir().unwrap();
        let ep = Endpoint::Unix(dir.path().join("p.sock"));
        let (entered_tx, entered) = mpsc::channel();
        let (release, release_rx) = mpsc::channel();
        let gate = Gate {
            inner: trainer(0.0, Format::Bf16).rollout().unwrap(),
            entered: entered_tx,
            release: Arc::new(Mutex::new(release_rx)),
        };
        let srv = start(&ep, gate, "h", |_| {});
        let cfg = SamplingConfig {
            temperature: 1.0,
            top_p: 1.0,
            max_new_tokens: 3,
        };
        let mut c = RolloutClient::connect(&srv.at, None).unwrap();
        let e = c.generate(&[vec![1]], 1, &cfg, 63, 0).unwrap_err();
        assert_eq!(reason(&e), Reason::EngineError);
        assert!(e.to_string().contains("a bug in the policy"), "{e}");
        // The engine is not poisoned.
        assert_eq!(c.generate(&[vec![1]], 2, &cfg, 0, 0).unwrap().1.len(), 2);

        // A generation held inside the engine; Info and Digest still answer meanwhile.
        let at = srv.at.clone();
        let long = std::thread::spawn(move || {
            let mut c2 = RolloutClient::connect(&at, None).unwrap();
            c2.generate(&[vec![1]], 1, &cfg, 62, 0).map(|r| r.1.len())
        });
        entered.recv_timeout(Duration::from_secs(20)).unwrap();
        assert_eq!(c.info().unwrap().version, 0);
        assert_eq!(c.digest().unwrap().tensors.len(), 1);
        release.send(()).unwrap();
        assert_eq!(long.join().unwrap().unwrap(), 1);
        srv.stop.stop();
        srv.h.join().unwrap();
    }

    #[test]
    fn tcp_needs_a_token_on_loopback_and_checks_it_on_every_call() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = trainer(0.0, Format::Bf16);
        let limits = Limits::for_model(SHAPE, &t0.rollout().unwrap().weights());
        let engine = || RolloutEngine::new(t0.rollout().unwrap(), 0, "h");
        let cfg = ServerConfig::new("bf16", "t", limits);
        let e = RolloutServer::bind(&Endpoint::Tcp("127.0.0.1:0".into()), engine(), cfg.clone())
            .unwrap_err();
        assert!(e.to_string().contains("--token-file"), "{e}");
        let mut with_token = cfg.clone();
        with_token.token = Some(Token::new("a-long-enough-secret").unwrap());
        let e = RolloutServer::bind(&Endpoint::Tcp("0.0.0.0:0".into()), engine(), with_token)
            .unwrap_err();
        assert!(
            e.to_string().contains("loopback") && e.to_string().contains("--tls-cert"),
            "{e}"
        );

        // Token files: too short, readable by others, fine.
        use std::os::unix::fs::PermissionsExt;
        let f = dir.path().join("tok");
        std::fs::write(&f, "short\n").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(Token::from_file(&f)
            .unwrap_err()
            .to_string()
            .contains("at least 16"));
        std::fs::write(&f, "0123456789abcdef0123\n").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Token::from_file(&f).unwrap_err().to_string();
        assert!(e.contains("chmod 600") && e.contains("tok"), "{e}");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        let token = Token::from_file(&f).unwrap();
        assert!(token.matches(b"0123456789abcdef0123"));
        assert!(!token.matches(b"0123456789abcdef0124"));
        assert!(!token.matches(b""));
        assert!(!format!("{token:?}").contains("0123"));

        let tok = token.clone();
        let srv = start(
            &Endpoint::Tcp("127.0.0.1:0".into()),
            t0.rollout().unwrap(),
            "h",
            |c| c.token = Some(tok),
        );
        let wrong = Token::new("0123456789abcdef0124").unwrap();
        let ex = trainer(1.0, Format::Bf16).export_weights().unwrap();
        for t in [None, Some(&wrong)] {
            let mut c = RolloutClient::connect(&srv.at, t).unwrap();
            for e in [
                c.info().unwrap_err(),
                c.fetch().unwrap_err(),
                c.digest().unwrap_err(),
                c.update(WeightUpdate::build(1, "h", &ex, 1 << 20))
                    .unwrap_err(),
                c.shutdown().unwrap_err(),
            ] {
                assert_eq!(reason(&e), Reason::Unauthenticated, "{e}");
            }
        }
        let mut c = RolloutClient::connect(&srv.at, Some(&token)).unwrap();
        assert_eq!(c.info().unwrap().version, 0, "nothing changed");
        assert_eq!(
            c.update(WeightUpdate::build(1, "h", &ex, 1 << 20)).unwrap(),
            1
        );
        c.shutdown().unwrap();
        srv.h.join().unwrap();
        let n = srv
            .rx
            .try_iter()
            .filter(|e| matches!(e, ServerEvent::Unauthenticated { .. }))
            .count();
        assert_eq!(n, 10);
    }

    /// Test certificates made with rcgen: a CA, and server certificates it signs.
    struct Pki {
        dir: tempfile::TempDir,
        ca: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    }

    impl Pki {
        fn new(name: &str) -> Pki {
            let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            p.distinguished_name
                .push(rcgen::DnType::CommonName, format!("{name} test CA"));
            p.key_usages = vec![
                rcgen::KeyUsagePurpose::KeyCertSign,
                rcgen::KeyUsagePurpose::CrlSign,
            ];
            let key = rcgen::KeyPair::generate().unwrap();
            Pki {
                dir: tempfile::tempdir().unwrap(),
                ca: rcgen::CertifiedIssuer::self_signed(p, key).unwrap(),
            }
        }

        /// The CA certificate as a PEM file.
        fn ca_file(&self) -> PathBuf {
            let f = self.dir.path().join("ca.pem");
            std::fs::write(&f, self.ca.pem()).unwrap();
            f
        }

        /// A server certificate for `names` (DNS names or IP addresses): (cert, key) files,
        /// the key owner-only.
        fn server(&self, tag: &str, names: &[&str]) -> (PathBuf, PathBuf) {
            use std::os::unix::fs::PermissionsExt;
            let mut p = rcgen::CertificateParams::new(
                names.iter().map(|n| n.to_string()).collect::<Vec<_>>(),
            )
            .unwrap();
            p.distinguished_name
                .push(rcgen::DnType::CommonName, "mxrl rollout server");
            p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = p.signed_by(&key, &self.ca).unwrap();
            let (c, k) = (
                self.dir.path().join(format!("{tag}.pem")),
                self.dir.path().join(format!("{tag}.key")),
            );
            std::fs::write(&c, cert.pem()).unwrap();
            std::fs::write(&k, key.serialize_pem()).unwrap();
            std::fs::set_permissions(&k, std::fs::Permissions::from_mode(0o600)).unwrap();
            (c, k)
        }
    }

    /// An address of this machine that is not loopback (the source address of its route to a
    /// documentation-only address; no packet is sent), or why there is none.
    fn machine_address() -> Result<std::net::IpAddr, String> {
        let s = std::net::UdpSocket::bind("0.0.0.0:0").map_err(|e| e.to_string())?;
        s.connect("192.0.2.1:9")
            .map_err(|e| format!("no route off this machine ({e})"))?;
        let ip = s.local_addr().map_err(|e| e.to_string())?.ip();
        if ip.is_loopback() || ip.is_unspecified() {
            return Err(format!("the route off this machine uses {ip}"));
        }
        Ok(ip)
    }

    /// TLS on loopback: the right CA works end to end (info, an update, generate, fetch), the
    /// token is still required, and a client without TLS, with another CA or checking another
    /// name fails to connect without the server noticing anything but a failed handshake,
    /// which it logs with the client's address.
    #[test]
    fn tls_serves_a_client_trusting_its_ca_and_nobody_else() {
        let pki = Pki::new("right");
        let (cert, key) = pki.server("server", &["rollout.test", "127.0.0.1"]);
        let ca = ClientTls::from_file(&pki.ca_file()).unwrap();
        let tls = ServerTls::from_files(&cert, &key).unwrap();
        let token = Token::new("tls-test-token-0123456").unwrap();
        let t0 = trainer(0.0, Format::Mxfp8);
        let (tok, tls2) = (token.clone(), tls.clone());
        let srv = start(
            &Endpoint::Tcp("127.0.0.1:0".into()),
            t0.rollout().unwrap(),
            "h",
            |c| {
                c.token = Some(tok);
                c.tls = Some(tls2);
            },
        );
        let mut c = RolloutClient::connect_tls(&srv.at, Some(&token), Some(&ca)).unwrap();
        assert_eq!(c.info().unwrap().version, 0);
        let ex = trainer(1.0, Format::Mxfp8).export_weights().unwrap();
        assert_eq!(
            c.update(WeightUpdate::build(1, "h", &ex, 1 << 20)).unwrap(),
            1
        );
        let (v, held) = c.fetch().unwrap();
        assert_eq!(v, 1);
        sync::check_equal(&held, &ex).unwrap();
        let cfg = SamplingConfig {
            temperature: 1.0,
            top_p: 1.0,
            max_new_tokens: 3,
        };
        let (v, s) = c.generate(&[vec![1, 2]], 2, &cfg, 0, 5).unwrap();
        assert_eq!((v, s.len()), (1, 2));
        // A remote rollout over TLS, and the name check against another name of the
        // certificate.
        let named = ca.clone().with_server_name("rollout.test");
        let r = RemoteRollout::connect_tls(&srv.at, "h", Some(&token), Some(&named)).unwrap();
        assert_eq!(r.version(), 1);

        // The token is still required over TLS.
        let mut anon = RolloutClient::connect_tls(&srv.at, None, Some(&ca)).unwrap();
        for e in [
            anon.info().unwrap_err(),
            anon.update(WeightUpdate::build(2, "h", &ex, 1 << 20))
                .unwrap_err(),
            anon.shutdown().unwrap_err(),
        ] {
            assert_eq!(reason(&e), Reason::Unauthenticated, "{e}");
        }
        let evs = until(&srv.rx, |e| {
            matches!(e, ServerEvent::Unauthenticated { .. })
        });
        let ServerEvent::Unauthenticated { peer } = evs.last().unwrap() else {
            unreachable!()
        };
        assert!(peer.ends_with("(TLS)"), "{peer}");

        // No TLS, another CA, another name: no call gets through, none is a typed refusal.
        let other = Pki::new("other");
        let wrong_ca = ClientTls::from_file(&other.ca_file()).unwrap();
        let wrong_name = ca.clone().with_server_name("elsewhere.test");
        let attempts: [(&str, Option<&ClientTls>, &str); 3] = [
            ("no TLS", None, "--tls-ca"),
            ("another CA", Some(&wrong_ca), "certificate"),
            ("another name", Some(&wrong_name), "certificate"),
        ];
        for (what, t, says) in attempts {
            let e = RolloutClient::connect_tls(&srv.at, Some(&token), t)
                .and_then(|mut c| c.info())
                .expect_err(what);
            assert!(e.refusal().is_none(), "{what}: {e}");
            assert!(e.to_string().contains(says), "{what}: {e}");
        }
        // A client that connects and closes without sending a byte.
        let Endpoint::Tcp(addr) = &srv.at else {
            unreachable!()
        };
        let raw = std::net::TcpStream::connect(addr).unwrap();
        let raw_peer = format!("tcp:{}", raw.local_addr().unwrap());
        drop(raw);
        // Each failed handshake is in the server's log with the client's address and what
        // its socket saw (a client may try more than once); a served connection that closes
        // reports none.
        let (mut failed, mut raw_seen) = (0, false);
        let mut seen = evs;
        seen.extend(until(&srv.rx, |e| {
            if let ServerEvent::TlsHandshakeFailed { peer, error } = e {
                failed += 1;
                if *peer == raw_peer {
                    assert_eq!(error, "the client closed the connection", "{e}");
                    raw_seen = true;
                }
            }
            failed > attempts.len() && raw_seen
        }));
        assert_eq!(c.info().unwrap().version, 1, "the server kept serving");
        drop(anon);
        std::thread::sleep(Duration::from_millis(300));
        c.shutdown().unwrap();
        srv.h.join().unwrap();
        seen.extend(srv.rx.try_iter());
        let served: Vec<&str> = seen
            .iter()
            .filter_map(|e| match e {
                ServerEvent::Applied { peer, .. }
                | ServerEvent::Unauthenticated { peer }
                | ServerEvent::Shutdown { peer } => peer.strip_suffix(" (TLS)"),
                _ => None,
            })
            .collect();
        assert!(served.len() >= 2, "{seen:?}");
        for e in &seen {
            if let ServerEvent::TlsHandshakeFailed { peer, error } = e {
                assert!(peer.starts_with("tcp:127.0.0.1:"), "{e}");
                assert!(!served.contains(&peer.as_str()), "{e} (served): {seen:?}");
                assert!(!error.is_empty(), "{e}");
            }
        }
    }

    /// Off loopback: the server refuses to start without TLS and a client refuses to connect
    /// without a CA (both naming the flags); with both, a server on this machine's network
    /// address serves a TLS client (skipped, with the reason printed, on a machine without
    /// one). Bad TLS files are refused naming the file.
    #[test]
    fn off_loopback_tcp_needs_tls_on_both_sides() {
        let t0 = trainer(0.0, Format::Bf16);
        let token = Token::new("tls-test-token-0123456").unwrap();
        let mut cfg = ServerConfig::new(
            "bf16",
            "t",
            Limits::for_model(SHAPE, &t0.rollout().unwrap().weights()),
        );
        cfg.token = Some(token.clone());
        let engine = || RolloutEngine::new(t0.rollout().unwrap(), 0, "h");
        let e = RolloutServer::bind(&Endpoint::Tcp("0.0.0.0:0".into()), engine(), cfg.clone())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("0.0.0.0") && e.contains("--tls-cert") && e.contains("--tls-key"),
            "{e}"
        );
        let e = RolloutClient::connect(&Endpoint::Tcp("192.0.2.1:7000".into()), Some(&token))
            .unwrap_err()
            .to_string();
        assert!(e.contains("192.0.2.1") && e.contains("--tls-ca"), "{e}");

        // Bad files: a key readable by others, a key of another certificate, a certificate
        // file without a certificate, a CA file without one.
        use std::os::unix::fs::PermissionsExt;
        let pki = Pki::new("files");
        let (cert, key) = pki.server("a", &["127.0.0.1"]);
        let (_, other_key) = pki.server("b", &["127.0.0.1"]);
        let mut tls_cfg = cfg.clone();
        tls_cfg.tls = Some(ServerTls::from_files(&cert, &key).unwrap());
        let e = RolloutServer::bind(
            &Endpoint::Unix(pki.dir.path().join("s.sock")),
            engine(),
            tls_cfg,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("TLS") && e.contains("Unix socket"), "{e}");
        let e = ServerTls::from_files(&cert, &other_key)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not usable together") && e.contains("b.key"),
            "{e}"
        );
        let e = ServerTls::from_files(&key, &key).unwrap_err().to_string();
        assert!(
            e.contains("holds no certificate") && e.contains("a.key"),
            "{e}"
        );
        let e = ClientTls::from_file(&key).unwrap_err().to_string();
        assert!(
            e.contains("TLS CA") && e.contains("holds no certificate"),
            "{e}"
        );
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = ServerTls::from_files(&cert, &key).unwrap_err().to_string();
        assert!(e.contains("chmod 600") && e.contains("a.key"), "{e}");

        let ip = match machine_address() {
            Ok(ip) => ip,
            Err(why) => {
                println!("skipping the TLS server on a network address: {why}");
                return;
            }
        };
        let host = ip.to_string();
        let (cert, key) = pki.server("net", &[&host]);
        let mut tls_cfg = cfg;
        tls_cfg.tls = Some(ServerTls::from_files(&cert, &key).unwrap());
        let at = Endpoint::Tcp(std::net::SocketAddr::new(ip, 0).to_string());
        let srv = RolloutServer::bind(&at, engine(), tls_cfg).unwrap();
        let at = srv.endpoint().clone();
        let stop = srv.stop_handle();
        let h = std::thread::spawn(move || srv.serve(&mut |_| {}).unwrap());
        let ca = ClientTls::from_file(&pki.ca_file()).unwrap();
        let mut c = RolloutClient::connect_tls(&at, Some(&token), Some(&ca)).unwrap();
        assert_eq!(c.info().unwrap().version, 0);
        let cfg = SamplingConfig {
            temperature: 1.0,
            top_p: 1.0,
            max_new_tokens: 3,
        };
        assert_eq!(c.generate(&[vec![3]], 2, &cfg, 0, 1).unwrap().1.len(), 2);
        let e = RolloutClient::connect(&at, Some(&token))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--tls-ca"), "{e}");
        stop.stop();
        h.join().unwrap();
    }

    #[test]
    fn sequence_limits_default_to_the_models_positions() {
        let shape = ModelShape {
            max_positions: 48,
            ..SHAPE
        };
        let l = Limits::for_model(shape, &[]);
        assert_eq!((l.max_sequence_length, l.max_new_tokens), (48, 48));
        let p = l.to_proto();
        assert_eq!((p.max_sequence_length, p.max_new_tokens), (48, 48));
        let e = check_generate(
            &l,
            pb::GenerateRequest {
                prompts: vec![pb::TokenIds { ids: vec![1; 40] }],
                n: 1,
                sampling: Some(pb::SamplingConfig {
                    temperature: 1.0,
                    top_p: 1.0,
                    max_new_tokens: 9,
                }),
                eos: 0,
                seed: 0,
            },
        )
        .err()
        .unwrap();
        assert_eq!(
            (e.reason, e.limit),
            (Reason::LimitExceeded, Some(("max_sequence_length", 48)))
        );
    }
}
