"""A writer of MXNet indexed RecordIO for the tests, written from the format's description
(dmlc-core's RecordIOWriter, mxnet.recordio's pack/IRHeader): not mxnet's code.

    with RecWriter(path_rec, path_idx) as w:
        w.write(key, pack_image(label, image_bytes))
"""

from __future__ import annotations

import struct
from pathlib import Path

MAGIC = struct.pack("<I", 0xCED7230A)


def pack_image(label: float | list[float], image: bytes, id_: int = 0, id2: int = 0) -> bytes:
    """An IRHeader (`<IfQQ`: flag, label, id, id2) and the image; a list of labels sets
    flag = len(labels), label = 0 and puts the labels (float32) after the header."""
    if isinstance(label, list):
        labels = struct.pack(f"<{len(label)}f", *label)
        return struct.pack("<IfQQ", len(label), 0.0, id_, id2) + labels + image
    return struct.pack("<IfQQ", 0, float(label), id_, id2) + image


def encode(payload: bytes) -> bytes:
    """One record's chunks: split where the magic stands at a 4-aligned offset of the
    payload (the magic itself is dropped and put back by readers), each chunk's data padded
    to 4 bytes; cflag 0 (whole) or 1, 2..., 3 (first, middle, last)."""
    out = bytearray()
    start = 0
    for i in range(0, len(payload) // 4 * 4, 4):
        if payload[i : i + 4] == MAGIC:
            out += MAGIC + struct.pack("<I", (1 if start == 0 else 2) << 29 | (i - start))
            out += payload[start:i]  # a multiple of 4 bytes: no padding
            start = i + 4
    rest = payload[start:]
    out += MAGIC + struct.pack("<I", (3 if start else 0) << 29 | len(rest)) + rest
    out += bytes(-len(rest) % 4)
    return bytes(out)


class RecWriter:
    def __init__(self, rec: Path, idx: Path | None) -> None:
        self.rec = open(rec, "wb")  # noqa: SIM115 - closed by close()/__exit__
        self.idx = open(idx, "w") if idx is not None else None  # noqa: SIM115

    def write(self, key: int | str, payload: bytes) -> int:
        at = self.rec.tell()
        self.rec.write(encode(payload))
        if self.idx is not None:
            self.idx.write(f"{key}\t{at}\n")
        return at

    def close(self) -> None:
        self.rec.close()
        if self.idx is not None:
            self.idx.close()

    def __enter__(self) -> RecWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
