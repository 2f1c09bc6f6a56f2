"""strata/checkpoint/erasure.py against references that do not share its code: decoding from every k-subset
back to the original bytes, parity equal to pyeclib's own ISA-L Cauchy backend, and parity computed
byte by byte in pure-Python GF(2^8)."""

from __future__ import annotations

import itertools
import mmap
import os
import random

import numpy as np
import pytest

from strata.checkpoint import erasure
from strata.checkpoint.erasure import ALIGN, Code
from strata.errors import StrataError


def split(code: Code, image: bytes) -> list[memoryview]:
    """The image padded with zeros and cut into k read-only fragments (views, no copies)."""
    f = code.fragment_len(len(image))
    padded = memoryview(image + bytes(code.k * f - len(image)))
    return [padded[i * f : (i + 1) * f] for i in range(code.k)]


def encoded(code: Code, image: bytes) -> list:
    data = split(code, image)
    parity = [bytearray(len(data[0])) for _ in range(code.m)]
    code.encode(data, parity)
    return data + parity


# --- (1) any k of the k+m fragments give the image back -----------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [0, 1, 2, 3])
def test_every_k_subset_decodes(k, m):
    rng = random.Random(k * 10 + m)
    image = rng.randbytes(100 * k + 37)  # 137, 237, 337, 437: no multiple of 64
    assert len(image) % ALIGN
    code = Code(k, m)
    frags = encoded(code, image)
    f = len(frags[0])
    assert f == code.fragment_len(len(image)) and f % ALIGN == 0
    for kept in itertools.combinations(range(k + m), k):
        lost = [i for i in range(k + m) if i not in kept]
        want = {i: bytearray(f) for i in lost}
        code.decode({i: frags[i] for i in kept}, want)
        for i in lost:  # the rebuilt fragments, parity included, are the encoded ones
            assert bytes(want[i]) == bytes(frags[i]), (kept, i)
        data = b"".join(bytes(want[i]) if i in want else bytes(frags[i]) for i in range(k))
        assert data[: len(image)] == image, kept
        assert not any(data[len(image) :])


def test_decode_with_more_than_k_and_nothing_wanted():
    code = Code(3, 2)
    image = os.urandom(1000)
    frags = encoded(code, image)
    want = {0: bytearray(len(frags[0]))}
    code.decode({i: frags[i] for i in range(1, 5)}, want)  # 4 survivors for k=3
    assert bytes(want[0]) == bytes(frags[0])
    code.decode({i: frags[i] for i in range(3)}, {})


# --- (2) parity against independent references --------------------------------------------------


@pytest.mark.parametrize("k,m", [(1, 1), (2, 1), (3, 2), (4, 2), (4, 3)])
def test_parity_matches_pyeclib(k, m):
    """pyeclib's `isa_l_rs_cauchy` fragments are an 80-byte header and the payload; the data
    payloads are the image cut in k, so our parity of those must equal its parity payloads; and our
    decode must rebuild the image from any k of its payloads."""
    from pyeclib.ec_iface import ECDriver

    image = random.Random(k + 7 * m).randbytes(1000 + k)
    payloads = [f[80:] for f in ECDriver(k=k, m=m, ec_type="isa_l_rs_cauchy").encode(image)]
    f = len(payloads[0])
    assert b"".join(payloads[:k])[: len(image)] == image
    parity = [bytearray(f) for _ in range(m)]
    Code(k, m).encode(payloads[:k], parity)
    assert [bytes(p) for p in parity] == payloads[k:]
    lost = list(range(m))  # data fragments, so decoding must invert
    want = {i: bytearray(f) for i in lost}
    Code(k, m).decode({i: payloads[i] for i in range(k + m) if i not in lost}, want)
    assert (
        b"".join(bytes(want[i]) if i in want else payloads[i] for i in range(k))[: len(image)]
        == image
    )


def _gf_tables():
    """exp/log tables of GF(2^8) with ISA-L's polynomial x^8 + x^4 + x^3 + x^2 + 1 (0x11D)."""
    exp, log = [0] * 510, [0] * 256
    x = 1
    for e in range(255):
        exp[e] = exp[e + 255] = x
        log[x] = e
        x <<= 1
        if x & 0x100:
            x ^= 0x11D
    return exp, log


def test_parity_matches_pure_python_gf256():
    exp, log = _gf_tables()

    def mul(a, b):
        return exp[log[a] + log[b]] if a and b else 0

    def inv(a):
        return exp[255 - log[a]]

    k, m = 3, 2
    image = random.Random(5).randbytes(201)
    code = Code(k, m)
    data = split(code, image)
    f = len(data[0])
    parity = [bytearray(f) for _ in range(m)]
    code.encode(data, parity)
    # gf_gen_cauchy1_matrix: rows k..k+m-1 are a[i][j] = 1 / (i ^ j)
    a = [[inv(i ^ j) for j in range(k)] for i in range(k, k + m)]
    for r in range(m):
        want = bytearray(f)
        for b in range(f):
            acc = 0
            for j in range(k):
                acc ^= mul(a[r][j], data[j][b])
            want[b] = acc
        assert parity[r] == want, r


# --- (3) bad arguments --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "k,m,key",
    [
        (0, 1, "snapshot.k"),
        (-1, 0, "snapshot.k"),
        (1, -1, "snapshot.m"),
        (200, 56, "snapshot.k + snapshot.m"),
        (2.0, 1, "snapshot.k"),
        (True, 1, "snapshot.k"),
        (2, None, "snapshot.m"),
    ],
)
def test_bad_code_parameters(k, m, key):
    with pytest.raises(ValueError, match=key.replace("+", r"\+")):
        Code(k, m)


def test_largest_code():
    code = Code(250, 5)
    frags = encoded(code, os.urandom(250 * ALIGN))
    want = {0: bytearray(ALIGN), 1: bytearray(ALIGN)}
    code.decode({i: frags[i] for i in range(2, 255)}, want)
    assert bytes(want[0]) == bytes(frags[0]) and bytes(want[1]) == bytes(frags[1])


def test_fragment_len():
    assert Code(1, 1).fragment_len(0) == ALIGN
    assert Code(1, 1).fragment_len(1) == ALIGN
    assert Code(2, 1).fragment_len(128) == ALIGN
    assert Code(2, 1).fragment_len(129) == 2 * ALIGN
    assert Code(3, 1).fragment_len(3 * 1000) == 1024
    with pytest.raises(ValueError):
        Code(2, 1).fragment_len(-1)


def test_bad_buffers():
    code = Code(2, 1)
    f = ALIGN
    d = [bytearray(f), bytearray(f)]
    with pytest.raises(ValueError, match="2 data and 1 parity"):
        code.encode(d[:1], [bytearray(f)])
    with pytest.raises(ValueError, match="2 data and 1 parity"):
        code.encode(d, [])
    with pytest.raises(ValueError, match=r"one length.*parity\[0\]=65"):
        code.encode(d, [bytearray(f + 1)])
    with pytest.raises(ValueError, match="at least 64 bytes"):
        code.encode([bytes(32), bytes(32)], [bytearray(32)])
    with pytest.raises(BufferError, match=r"parity\[0\] must be a writable"):
        code.encode(d, [bytes(f)])
    with pytest.raises(TypeError, match=r"data\[1\]"):
        code.encode([d[0], "text"], [bytearray(f)])
    with pytest.raises((BufferError, ValueError), match=r"data\[0\]"):  # not contiguous
        code.encode([memoryview(bytearray(2 * f))[::2], d[1]], [bytearray(f)])
    with pytest.raises(ValueError, match="only 1 of the k=2 fragments"):
        code.decode({2: bytes(f)}, {0: bytearray(f)})
    with pytest.raises(ValueError, match=r"indices \[3\]"):
        code.decode({0: bytes(f), 3: bytes(f)}, {})
    with pytest.raises(ValueError, match=r"want has fragment indices \[-1\]"):
        code.decode({0: bytes(f), 1: bytes(f)}, {-1: bytearray(f)})
    with pytest.raises(BufferError, match=r"want\[2\]"):
        code.decode({0: bytes(f), 1: bytes(f)}, {2: bytes(f)})


def test_library_path(monkeypatch):
    path = erasure.library_path()
    assert "isal" in os.path.basename(path)
    monkeypatch.setattr(erasure.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(erasure.ctypes.util, "find_library", lambda name: "libisal.so.2")
    assert erasure.library_path() == "libisal.so.2"
    monkeypatch.setattr(erasure.ctypes.util, "find_library", lambda name: None)
    with pytest.raises(StrataError, match=r"pip install pyeclib==1\.8\.0"):
        erasure.library_path()


def test_self_test():
    erasure.self_test()


# --- (4) buffer types ---------------------------------------------------------------------------


def test_buffer_kinds(tmp_path):
    k, m = 2, 2
    code = Code(k, m)
    image = os.urandom(2 * 300)
    f = code.fragment_len(len(image))
    ref = [bytes(x) for x in encoded(code, image)]  # parity from bytearray outputs

    # data: bytes (read-only), a read-only file mmap; parity: slices of one bytearray and an anonymous mmap
    path = tmp_path / "frag1"
    path.write_bytes(ref[1])
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as ro:
        store = bytearray(3 * f)
        anon = mmap.mmap(-1, f)
        code.encode([ref[0], ro], [memoryview(store)[f : 2 * f], anon])
        assert bytes(store[f : 2 * f]) == ref[2] and anon[:] == ref[3]
        assert not any(store[:f]) and not any(store[2 * f :])  # wrote exactly the slice
        # decode from mixed kinds into an mmap, a numpy array and a memoryview slice
        out_data, out_np, out_mv = mmap.mmap(-1, f), np.zeros(f, np.uint8), bytearray(f + 10)
        code.decode(
            {1: ro, 2: memoryview(store)[f : 2 * f], 3: np.frombuffer(ref[3], np.uint8)},
            {0: out_data, 2: out_np, 3: memoryview(out_mv)[5 : 5 + f]},
        )
        assert (
            out_data[:] == ref[0]
            and out_np.tobytes() == ref[2]
            and bytes(out_mv[5 : 5 + f]) == ref[3]
        )
        anon.close()
        out_data.close()
    # numpy inputs, including a non-byte dtype: lengths are in bytes
    parity = [np.zeros(f, np.uint8), np.zeros(f // 4, np.float32)]
    code.encode([np.frombuffer(ref[0], np.uint8), np.frombuffer(ref[1], np.int32)], parity)
    assert parity[0].tobytes() == ref[2] and parity[1].tobytes() == ref[3]


# --- (5) long fragments: striped over threads ----------------------------------------------------


def test_long_fragments_striped_over_threads():
    from pyeclib.ec_iface import ECDriver

    k, m = 2, 1
    f = 3 * (1 << 20) + 100  # 3 pieces, the last one 1 MiB + 100 bytes
    assert f // erasure.PIECE >= 2
    image = np.random.default_rng(0).integers(0, 256, k * f, dtype=np.uint8).tobytes()
    data = [memoryview(image)[i * f : (i + 1) * f] for i in range(k)]
    parity = [bytearray(f)]
    code = Code(k, m)
    code.encode(data, parity)
    assert erasure._pool is not None  # the threaded path ran
    assert bytes(parity[0]) == ECDriver(k=k, m=m, ec_type="isa_l_rs_cauchy").encode(image)[k][80:]
    want = {0: bytearray(f)}
    code.decode({1: data[1], 2: parity[0]}, want)
    assert want[0] == data[0]
