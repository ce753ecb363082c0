#!/usr/bin/env python3
"""Regenerates the malformed-input corpus used by tests/corpus.rs and the cargo-fuzz targets.

Run from this directory: python3 make_corpus.py. Each case is written as a file, and
expected.json maps file name -> a substring the error message must contain.
"""
import json
import struct

def st(header, data=b"", raw_header=None, length=None):
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    n = len(h) if length is None else length
    return struct.pack("<Q", n) + h + data

def t(dtype, shape, b, e):
    return {"dtype": dtype, "shape": shape, "data_offsets": [b, e]}

headers = {
    "empty.st": (b"", "truncated"),
    "short_len.st": (b"\x10\x00\x00", "truncated"),
    "len_past_file.st": (st({}, length=4096), "truncated"),
    "huge_len.st": (struct.pack("<Q", 1 << 62) + b"{}", "exceeds"),
    "not_json.st": (st(None, raw_header=b"{not json"), "not valid JSON"),
    "not_utf8.st": (st(None, raw_header=b"{\"\xff\xfe\": 1}"), "not UTF-8"),
    "not_object.st": (st([1, 2, 3]), "must be a JSON object"),
    "entry_not_object.st": (st({"w": 5}), "entry must be an object"),
    "unknown_dtype.st": (st({"w": t("F4", [2], 0, 1)}, b"\0"), "unsupported dtype `F4`"),
    "dtype_not_string.st": (st({"w": {"dtype": 3, "shape": [1], "data_offsets": [0, 1]}}, b"\0"), "`dtype` must be a string"),
    "missing_shape.st": (st({"w": {"dtype": "U8", "data_offsets": [0, 1]}}, b"\0"), "missing field `shape`"),
    "negative_dim.st": (st({"w": t("U8", [-1], 0, 1)}, b"\0"), "non-negative integers"),
    "float_dim.st": (st({"w": t("U8", [1.5], 0, 1)}, b"\0"), "non-negative integers"),
    "three_offsets.st": (st({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}}, b"\0"), "must have 2 entries"),
    "reversed_offsets.st": (st({"w": t("U8", [0], 4, 2)}, b"\0" * 4), "end before they begin"),
    "size_mismatch.st": (st({"w": t("BF16", [4], 0, 4)}, b"\0" * 4), "needs 8 bytes"),
    "shape_overflow.st": (st({"w": t("F32", [1 << 62, 1 << 62], 0, 16)}, b"\0" * 16), "overflows"),
    "past_end.st": (st({"w": t("U8", [16], 0, 16)}, b"\0" * 8), "run past the end"),
    "overlap.st": (st({"a": t("U8", [8], 0, 8), "b": t("U8", [8], 4, 12)}, b"\0" * 12), "overlap"),
    "gap.st": (st({"a": t("U8", [4], 0, 4), "b": t("U8", [4], 8, 12)}, b"\0" * 12), "gap"),
    "trailing.st": (st({"a": t("U8", [4], 0, 4)}, b"\0" * 8), "trailing"),
    "metadata_not_string.st": (st({"__metadata__": {"format": 1}}), "must be a string"),
    "unknown_field.st": (st({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": 0}}, b"\0"), "unknown field `x`"),
}

index = {
    "not_json.json": (b"{", "not valid JSON"),
    "no_weight_map.json": (json.dumps({"metadata": {}}).encode(), "missing field `weight_map`"),
    "weight_map_list.json": (json.dumps({"weight_map": []}).encode(), "must be an object"),
    "empty_weight_map.json": (json.dumps({"weight_map": {}}).encode(), "is empty"),
    "shard_not_string.json": (json.dumps({"weight_map": {"w": 3}}).encode(), "must be a shard file name"),
    "shard_traversal.json": (json.dumps({"weight_map": {"w": "../x.safetensors"}}).encode(), "not a plain"),
    "shard_abs.json": (json.dumps({"weight_map": {"w": "/etc/passwd"}}).encode(), "not a plain"),
    "shard_not_safetensors.json": (json.dumps({"weight_map": {"w": "model.bin"}}).encode(), "not a plain"),
    "total_size_negative.json": (json.dumps({"metadata": {"total_size": -5}, "weight_map": {"w": "a.safetensors"}}).encode(), "total_size"),
    "metadata_list.json": (json.dumps({"metadata": [], "weight_map": {"w": "a.safetensors"}}).encode(), "`metadata` must be an object"),
}

for folder, cases in (("headers", headers), ("index", index)):
    expected = {}
    for name, (data, msg) in cases.items():
        with open(f"{folder}/{name}", "wb") as f:
            f.write(data)
        expected[name] = msg
    with open(f"{folder}/expected.json", "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
