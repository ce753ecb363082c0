#!/usr/bin/env python3
"""A Python client of the mxrl rollout service (`mxrl rollout-server`), built at run time from
the same `crates/mxrl-rl/proto/rollout.proto` the server is compiled from.

Needs `grpcio` and `grpcio-tools` (pip install grpcio grpcio-tools). A PyTorch trainer can use
`RolloutClient` to sample from an mxrl rollout engine and push its own weights to it:

    c = RolloutClient("unix:/tmp/ro.sock")                      # or "tcp:HOST:7000", token=...,
                                                                # tls_ca="ca.pem" (TLS)
    info = c.info()                                             # version, contract hash, limits
    samples = c.generate([[1, 2, 3]], n=4, max_new_tokens=16)
    version, tensors = c.fetch()                                # the held weights, byte for byte
    c.update(version + 1, tensors)                              # bucketed, SHA-256 per bucket

Refusals raise `Refused` carrying the typed `Refusal` of the `mxrl-refusal-bin` trailer
(reason, the version the server still serves, the limit).

Command line: `rollout_client.py --address ADDR [--token-file F] [--tls-ca CA.pem
[--tls-server-name NAME]] info|digest|shutdown|selftest`.
`selftest` is what the repository's test runs: it drives every call once and checks the
answers, printing one JSON object.
"""

import argparse
import hashlib
import importlib
import json
import os
import sys
import tempfile

PROTO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "mxrl-rl",
                     "proto", "rollout.proto")
REFUSAL_TRAILER = "mxrl-refusal-bin"


def load_protocol(proto=PROTO):
    """Compile `proto` with grpc_tools.protoc into a temporary directory and import it:
    returns (messages module, services module)."""
    from grpc_tools import protoc
    import grpc_tools

    out = tempfile.mkdtemp(prefix="mxrl-proto-")
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    src = os.path.dirname(os.path.abspath(proto))
    rc = protoc.main(["protoc", f"-I{src}", f"-I{include}", f"--python_out={out}",
                      f"--grpc_python_out={out}", os.path.abspath(proto)])
    if rc != 0:
        raise RuntimeError(f"protoc failed on {proto} (exit {rc})")
    sys.path.insert(0, out)
    name = os.path.splitext(os.path.basename(proto))[0]
    return importlib.import_module(f"{name}_pb2"), importlib.import_module(f"{name}_pb2_grpc")


pb, pb_grpc = load_protocol()


class Refused(Exception):
    """A call the server refused: gRPC code, message and the typed Refusal."""

    def __init__(self, code, message, refusal):
        self.code, self.message, self.refusal = code, message, refusal
        reason = pb.Refusal.Reason.Name(refusal.reason) if refusal else "no refusal trailer"
        super().__init__(f"{code.name}: {reason}: {message}")

    @property
    def reason(self):
        return pb.Refusal.Reason.Name(self.refusal.reason) if self.refusal else None


def _refusal(err):
    for key, value in err.trailing_metadata() or ():
        if key == REFUSAL_TRAILER:
            r = pb.Refusal()
            r.ParseFromString(value)
            return r
    return None


def read_token(path):
    st = os.stat(path)
    if st.st_mode & 0o077:
        raise SystemExit(f"token file {path}: readable by others; chmod 600 it")
    with open(path) as f:
        return f.read().strip()


def _require_loopback(target):
    """Refuse a plain TCP target `HOST:PORT` that resolves to anything but loopback."""
    import ipaddress
    import socket

    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    addrs = {ai[4][0] for ai in socket.getaddrinfo(host, int(port), proto=socket.IPPROTO_TCP)}
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise ValueError(f"tcp:{target} resolves to {sorted(addrs)}, not only loopback addresses: "
                         "the token would cross the network in clear; pass --tls-ca CA.pem")


class RolloutClient:
    """Blocking client of the three services (Rollout, Sampler, WeightSync).

    `tls_ca`: PEM file of the authority that signed the server's `--tls-cert`; the channel
    then uses TLS (TCP only), checking the server's certificate against the address's host
    or `server_name`. Without it, TCP is plain and refused unless the host resolves to
    loopback addresses only, so the token never crosses a network in clear."""

    def __init__(self, address, token=None, tls_ca=None, server_name=None):
        import grpc

        self._grpc = grpc
        opts = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
                ("grpc.keepalive_time_ms", 30000), ("grpc.keepalive_permit_without_calls", 1)]
        if address.startswith("unix:"):
            target = "unix://" + os.path.abspath(address[len("unix:"):])
        elif address.startswith("tcp:"):
            target = address[len("tcp:"):]
        else:
            raise ValueError(f"address {address!r}: expected unix:PATH or tcp:HOST:PORT")
        if tls_ca is not None:
            if not address.startswith("tcp:"):
                raise ValueError(f"address {address!r}: TLS (tls_ca) is for tcp:HOST:PORT")
            with open(tls_ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            if server_name:
                opts.append(("grpc.ssl_target_name_override", server_name))
            self.channel = grpc.secure_channel(target, creds, options=opts)
        else:
            if address.startswith("tcp:"):
                _require_loopback(target)
            self.channel = grpc.insecure_channel(target, options=opts)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.control = pb_grpc.RolloutStub(self.channel)
        self.sampler = pb_grpc.SamplerStub(self.channel)
        self.sync = pb_grpc.WeightSyncStub(self.channel)

    def _call(self, fn, req):
        try:
            return fn(req, metadata=self.metadata)
        except self._grpc.RpcError as e:
            raise Refused(e.code(), e.details(), _refusal(e)) from None

    def info(self):
        return self._call(self.control.Info, pb.InfoRequest())

    def digest(self):
        return self._call(self.control.Digest, pb.DigestRequest())

    def shutdown(self):
        return self._call(self.control.Shutdown, pb.ShutdownRequest())

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=8, eos=0, seed=0):
        req = pb.GenerateRequest(
            prompts=[pb.TokenIds(ids=p) for p in prompts], n=n, eos=eos, seed=seed,
            sampling=pb.SamplingConfig(temperature=temperature, top_p=top_p,
                                       max_new_tokens=max_new_tokens))
        return self._call(self.sampler.Generate, req)

    def score(self, sequences, temperature=1.0):
        """sequences: (prompt ids, response ids) pairs."""
        req = pb.ScoreRequest(temperature=temperature, sequences=[
            pb.ScoreSequence(prompt=p, response=r) for p, r in sequences])
        return self._call(self.sampler.Score, req)

    def fetch(self):
        """(version, [Tensor]) held by the server; every bucket's SHA-256 checked."""
        tensors, version = [], None
        try:
            for m in self.control.Fetch(pb.FetchRequest(), metadata=self.metadata):
                kind = m.WhichOneof("kind")
                if kind == "header":
                    version = m.header.version
                elif kind == "bucket":
                    if hashlib.sha256(m.bucket.payload).digest() != m.bucket.sha256:
                        raise RuntimeError(f"fetched bucket {m.bucket.index}: bad SHA-256")
                    tensors.extend(pb.TensorList.FromString(m.bucket.payload).tensors)
        except self._grpc.RpcError as e:
            raise Refused(e.code(), e.details(), _refusal(e)) from None
        return version, tensors

    @staticmethod
    def update_messages(version, contract_hash, tensors, bucket_bytes=1 << 20):
        """The messages of a weight update: header, buckets (a tensor never split), commit."""
        payloads, cur, size = [], [], 0
        for t in tensors:
            n = t.ByteSize() + 8
            if cur and size + n > bucket_bytes:
                payloads.append(pb.TensorList(tensors=cur).SerializeToString())
                cur, size = [], 0
            cur.append(t)
            size += n
        if cur or not payloads:
            payloads.append(pb.TensorList(tensors=cur).SerializeToString())
        yield pb.UpdateMessage(header=pb.UpdateHeader(
            version=version, contract_hash=contract_hash, buckets=len(payloads),
            tensors=len(tensors), bytes=sum(len(p) for p in payloads)))
        for i, p in enumerate(payloads):
            yield pb.UpdateMessage(bucket=pb.WeightBucket(
                index=i, sha256=hashlib.sha256(p).digest(), payload=p))
        yield pb.UpdateMessage(commit=pb.Commit(version=version))

    def update(self, version, tensors, contract_hash=None, bucket_bytes=1 << 20):
        """Send tensors (already in the server's formats) as weight `version`."""
        if contract_hash is None:
            contract_hash = self.info().contract_hash
        msgs = self.update_messages(version, contract_hash, tensors, bucket_bytes)
        return self._call(self.sync.UpdateWeights, msgs)


def selftest(c, args):
    """Every call once, with checks; returns a dict for the caller to compare."""
    out = {}
    info = c.info()
    out["protocol"], out["version"] = info.protocol, info.version
    out["contract_hash"], out["tensors"] = info.contract_hash, info.tensors
    version, tensors = c.fetch()
    assert version == info.version and len(tensors) == info.tensors, (version, len(tensors))
    # The digest of what was fetched equals the server's digest.
    d = c.digest()
    for t, g in zip(tensors, d.tensors):
        assert t.name == g.name and hashlib.sha256(t.data).digest() == g.data_sha256, t.name
    # New weights from Python: every BF16 tensor negated (sign bit of each little-endian BF16).
    changed = []
    for t in tensors:
        if t.format == pb.FORMAT_BF16:
            data = bytearray(t.data)
            for i in range(1, len(data), 2):
                data[i] ^= 0x80
            t.data = bytes(data)
            changed.append(t.name)
    reply = c.update(version + 1, tensors, bucket_bytes=args.bucket_bytes)
    out["applied"], out["negated"] = reply.version, changed
    # A stale update is refused with a typed reason and the served version.
    try:
        c.update(version + 1, tensors)
        raise AssertionError("a stale update was accepted")
    except Refused as e:
        assert e.reason == "STALE_VERSION" and e.refusal.serving_version == version + 1, e
        out["stale_refusal"] = e.reason
    # A bucket with a wrong checksum: DATA_LOSS / BAD_CHECKSUM, nothing changes.
    msgs = list(RolloutClient.update_messages(version + 2, info.contract_hash, tensors))
    msgs[1].bucket.sha256 = bytes(32)
    try:
        c._call(c.sync.UpdateWeights, iter(msgs))
        raise AssertionError("a corrupt bucket was accepted")
    except Refused as e:
        assert e.reason == "BAD_CHECKSUM", e
        out["checksum_refusal"] = e.reason
    # A token id outside the vocabulary: INVALID_REQUEST.
    try:
        c.generate([[info.limits.vocab_size]], n=1)
        raise AssertionError("an out-of-vocabulary prompt was accepted")
    except Refused as e:
        assert e.reason == "INVALID_REQUEST", e
        out["vocab_refusal"] = e.reason
    g = c.generate([[1, 2, 3], [4]], n=2, temperature=0.8, max_new_tokens=4, seed=7)
    assert g.version == version + 1 and len(g.samples) == 4
    out["samples"] = [list(s.response) for s in g.samples]
    out["logprobs"] = [list(s.logprobs) for s in g.samples]
    s = c.score([(list(x.prompt), list(x.response)) for x in g.samples if len(x.response) > 0],
                temperature=0.8)
    out["scored"] = len(s.logprobs)
    out["digest_version"] = c.digest().version
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", required=True, help="unix:PATH or tcp:HOST:PORT")
    ap.add_argument("--token-file", help="the server's shared secret (TCP)")
    ap.add_argument("--tls-ca", help="TLS: PEM file of the CA that signed the server's certificate")
    ap.add_argument("--tls-server-name", help="TLS: check the certificate against this name")
    ap.add_argument("--bucket-bytes", type=int, default=1 << 20)
    ap.add_argument("command", choices=["info", "digest", "shutdown", "selftest"])
    args = ap.parse_args()
    token = read_token(args.token_file) if args.token_file else None
    c = RolloutClient(args.address, token, tls_ca=args.tls_ca, server_name=args.tls_server_name)
    from google.protobuf import json_format

    if args.command == "selftest":
        print(json.dumps(selftest(c, args)))
    else:
        reply = getattr(c, args.command)()
        print(json_format.MessageToJson(reply))


if __name__ == "__main__":
    main()
