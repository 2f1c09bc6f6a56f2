"""Reed–Solomon erasure coding of snapshot images: k data fragments plus m parity fragments with
ISA-L's Cauchy code, called through ctypes, so that any k of the k+m fragments rebuild the image."""

from __future__ import annotations

# Why ctypes straight to ISA-L rather than pyeclib's Python API (docs/design/snapshot.md §1): that
# API takes only `bytes` (no memoryview of a shared-memory image), holds the GIL, prefixes every
# fragment with an 80-byte header and allocates fresh outputs per call: 0.5–0.95 GB/s at 64 MiB. The
# same library through ctypes reads the caller's buffers in place, writes parity into preallocated
# ones, releases the GIL, and ran at ~12 GB/s on one thread. We still install pyeclib: its wheel
# bundles ISA-L. This module imports no torch (it runs in the snapshot agent) and no numpy.
import ctypes
import ctypes.util
import functools
import glob
import importlib.util
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

from strata.errors import StrataError

ALIGN = 64  # fragment length multiple (some ISA-L SIMD kernels need >= 64)
PIECE = 1 << 20  # column piece per ISA-L call when a fragment is long enough to share out
THREADS = 2  # threads a long encode or decode is spread over (the calling thread is one of them)
MAX_FRAGMENTS = 255  # GF(2^8): a Cauchy matrix has at most 255 distinct rows

Buffer = object  # any C-contiguous buffer: bytes, bytearray, mmap, memoryview, numpy array


def library_path() -> str:
    """Where ISA-L is: the copy bundled in pyeclib's wheel, else a system libisal."""
    spec = importlib.util.find_spec("pyeclib")  # locates the package without importing it
    for location in (spec.submodule_search_locations or []) if spec else []:
        libs = os.path.join(os.path.dirname(os.path.abspath(location)), "pyeclib.libs")
        found = sorted(glob.glob(os.path.join(libs, "libisal*.so*")))
        if found:
            return found[0]
    system = ctypes.util.find_library("isal")
    if system:
        return system
    raise StrataError(
        "erasure coding needs ISA-L: pip install pyeclib==1.8.0 (its wheel bundles it)"
    )


@functools.cache
def _lib() -> ctypes.CDLL:
    path = library_path()
    try:
        lib = ctypes.CDLL(path)
        for name in (
            "gf_gen_cauchy1_matrix",
            "ec_init_tables",
            "ec_encode_data",
            "gf_invert_matrix",
            "gf_mul",
        ):
            getattr(lib, name)
    except (OSError, AttributeError) as e:
        raise StrataError(
            f"erasure coding: cannot use ISA-L at {path}: {e}; pip install pyeclib==1.8.0 (its "
            "wheel bundles it)"
        ) from e
    u8, u8p, ptrs = ctypes.c_ubyte, ctypes.POINTER(ctypes.c_ubyte), ctypes.POINTER(ctypes.c_void_p)
    c_int = ctypes.c_int
    lib.gf_gen_cauchy1_matrix.argtypes, lib.gf_gen_cauchy1_matrix.restype = (
        [u8p, c_int, c_int],
        None,
    )
    lib.ec_init_tables.argtypes, lib.ec_init_tables.restype = [c_int, c_int, u8p, u8p], None
    lib.ec_encode_data.argtypes = [c_int, c_int, c_int, u8p, ptrs, ptrs]
    lib.ec_encode_data.restype = None
    lib.gf_invert_matrix.argtypes, lib.gf_invert_matrix.restype = [u8p, u8p, c_int], c_int
    lib.gf_mul.argtypes, lib.gf_mul.restype = [u8, u8], u8
    return lib


# --- zero-copy access to any buffer, read-only ones included -----------------------------------
# ctypes' from_buffer wants a writable buffer; PyObject_GetBuffer takes any, gives its address and
# pins it (an mmap cannot be closed, a bytearray not resized) until PyBuffer_Release.


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_void_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_PyBUF_SIMPLE, _PyBUF_WRITABLE = 0, 1  # both ask for a C-contiguous buffer
# Own prototypes, so that the argtypes of the shared ctypes.pythonapi functions stay untouched.
_get_buffer = ctypes.PYFUNCTYPE(
    ctypes.c_int, ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int
)(("PyObject_GetBuffer", ctypes.pythonapi))
_release_buffer = ctypes.PYFUNCTYPE(None, ctypes.POINTER(_PyBuffer))(
    ("PyBuffer_Release", ctypes.pythonapi)
)


class _Pinned:
    """Buffers held exported for one call; `add` returns (address, length in bytes)."""

    def __init__(self):
        self._views: list[_PyBuffer] = []

    def add(self, obj: Buffer, writable: bool, what: str) -> tuple[int, int]:
        """Hold `obj`'s buffer exported until the call ends; returns its address and length, or
        raises naming `what` if it is not a (writable) contiguous buffer."""
        view = _PyBuffer()
        try:
            _get_buffer(obj, ctypes.byref(view), _PyBUF_WRITABLE if writable else _PyBUF_SIMPLE)
        except (BufferError, TypeError, ValueError) as e:
            kind = "a writable" if writable else "a"
            raise type(e)(f"{what} must be {kind} contiguous buffer: {e}") from None
        self._views.append(view)
        return view.buf or 0, view.len

    def __enter__(self) -> _Pinned:
        return self

    def __exit__(self, *exc) -> None:
        for view in self._views:
            _release_buffer(ctypes.byref(view))
        self._views.clear()


# --- striping over threads ------------------------------------------------------------------------
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _workers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=THREADS - 1, thread_name_prefix="strata-erasure")
        return _pool


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _ptrs(addresses: Sequence[int], offset: int):
    return (ctypes.c_void_p * len(addresses))(*[a + offset for a in addresses])


def _run(tables, k: int, rows: int, srcs: Sequence[int], dsts: Sequence[int], n: int) -> None:
    """dsts[r] = sum over j of row r of the coding matrix times srcs[j], over n bytes (ISA-L
    ec_encode_data); long fragments in PIECE columns shared by THREADS threads (ctypes drops the GIL)."""
    lib = _lib()
    pieces = n // PIECE  # also keeps each call's length within ISA-L's int
    if pieces < 2:
        lib.ec_encode_data(n, k, rows, tables, _ptrs(srcs, 0), _ptrs(dsts, 0))
        return
    lock, next_piece = threading.Lock(), [0]

    def work() -> None:
        while True:
            with lock:
                i = next_piece[0]
                next_piece[0] += 1
            if i >= pieces:
                return
            offset = i * PIECE
            size = PIECE if i < pieces - 1 else n - offset  # the last piece takes the remainder
            lib.ec_encode_data(size, k, rows, tables, _ptrs(srcs, offset), _ptrs(dsts, offset))

    futures = [_workers().submit(work) for _ in range(min(THREADS, pieces) - 1)]
    try:
        work()
    finally:
        wait(futures)  # the buffers are released after we return: no thread may still use them
    for f in futures:
        f.result()


# --- the code -------------------------------------------------------------------------------------


@functools.cache
def _matrix(k: int, m: int) -> bytes:
    """ISA-L's (k+m) x k Cauchy matrix, row-major: identity on top, a[i][j] = 1/(i ^ j) below."""
    a = (ctypes.c_ubyte * ((k + m) * k))()
    _lib().gf_gen_cauchy1_matrix(a, k + m, k)
    return bytes(a)


def _tables(k: int, rows: bytes):
    """ISA-L's expanded multiplication tables for a (len(rows) / k) x k coding matrix."""
    nrows = len(rows) // k
    tables = (ctypes.c_ubyte * (32 * k * nrows))()
    _lib().ec_init_tables(k, nrows, (ctypes.c_ubyte * len(rows)).from_buffer_copy(rows), tables)
    return tables


@functools.cache
def _encode_tables(k: int, m: int):
    return _tables(k, _matrix(k, m)[k * k :])


@functools.lru_cache(maxsize=256)
def _decode_tables(k: int, m: int, survivors: tuple[int, ...], wanted: tuple[int, ...]):
    """Tables that compute the `wanted` fragments straight from the k `survivors`, in one pass: with
    B the survivors' rows of the matrix A, data = B^-1 · survivors, so fragment w = A[w] · B^-1 ·
    survivors (for data w, A[w] · B^-1 is just row w of B^-1)."""
    lib, a = _lib(), _matrix(k, m)
    b = (ctypes.c_ubyte * (k * k)).from_buffer_copy(
        b"".join(a[s * k : (s + 1) * k] for s in survivors)
    )
    inv = (ctypes.c_ubyte * (k * k))()
    if lib.gf_invert_matrix(b, inv, k) != 0:  # cannot happen for a Cauchy matrix; a broken library?
        raise StrataError(
            f"erasure coding: ISA-L at {library_path()} found the k={k}, m={m} Cauchy rows "
            f"{list(survivors)} singular"
        )
    rows = bytearray()
    for w in wanted:
        if w < k:
            rows += bytes(inv[w * k : (w + 1) * k])
        else:
            for j in range(k):
                acc = 0
                for i in range(k):
                    acc ^= lib.gf_mul(a[w * k + i], inv[i * k + j])
                rows.append(acc)
    return _tables(k, bytes(rows))


class Code:
    """A (k data + m parity) Cauchy Reed-Solomon code."""

    def __init__(self, k: int, m: int):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"snapshot.k must be an integer >= 1, got {k!r}")
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"snapshot.m must be an integer >= 0, got {m!r}")
        if k + m > MAX_FRAGMENTS:
            raise ValueError(
                f"snapshot.k + snapshot.m must be <= {MAX_FRAGMENTS} (GF(2^8)), got "
                f"{k} + {m} = {k + m}"
            )
        self.k, self.m = k, m
        self._encode = _encode_tables(k, m) if m else None

    def __repr__(self) -> str:
        return f"Code(k={self.k}, m={self.m})"

    def fragment_len(self, nbytes: int) -> int:
        """Bytes per fragment for an image of `nbytes`: ceil(nbytes / k) rounded up to ALIGN, at least
        ALIGN. The caller pads the image with zeros to k times this."""
        if nbytes < 0:
            raise ValueError(f"image size must be >= 0, got {nbytes}")
        per = -(-nbytes // self.k)
        return max(ALIGN, -(-per // ALIGN) * ALIGN)

    def encode(self, data: Sequence[Buffer], parity: Sequence[Buffer]) -> None:
        """Fill the m `parity` buffers (writable) from the k `data` buffers (may be read-only), all of
        one length F >= ALIGN. Reads and writes in place: no copies."""
        if len(data) != self.k or len(parity) != self.m:
            raise ValueError(
                f"{self!r}.encode takes {self.k} data and {self.m} parity buffers, got "
                f"{len(data)} and {len(parity)}"
            )
        with _Pinned() as pin:
            srcs, n = self._pin(
                pin,
                [(f"data[{i}]", d, False) for i, d in enumerate(data)]
                + [(f"parity[{i}]", p, True) for i, p in enumerate(parity)],
            )
            if self.m:
                _run(self._encode, self.k, self.m, srcs[: self.k], srcs[self.k :], n)

    def decode(self, have: Mapping[int, Buffer], want: Mapping[int, Buffer]) -> None:
        """Rebuild fragments: `have` maps fragment index (0..k+m-1; data first, then parity) to a
        buffer of F bytes, at least k of them; each buffer of `want` (writable, F bytes, not one of
        `have`'s) is filled with the fragment of its index, data or parity."""
        k, n_frag = self.k, self.k + self.m
        for what, d in (("have", have), ("want", want)):
            bad = [
                i for i in d if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_frag
            ]
            if bad:
                raise ValueError(
                    f"{self!r}.decode: {what} has fragment indices {bad}; valid are 0..{n_frag - 1}"
                )
        if len(have) < k:
            raise ValueError(
                f"{self!r}.decode: only {len(have)} of the k={k} fragments needed "
                f"(have {sorted(have)})"
            )
        survivors = tuple(sorted(have)[:k])  # data first: their rows of the matrix are unit rows
        wanted = tuple(sorted(want))
        with _Pinned() as pin:
            addrs, n = self._pin(
                pin,
                [(f"have[{i}]", have[i], False) for i in survivors]
                + [(f"want[{i}]", want[i], True) for i in wanted],
            )
            if wanted:
                _run(
                    _decode_tables(k, self.m, survivors, wanted),
                    k,
                    len(wanted),
                    addrs[:k],
                    addrs[k:],
                    n,
                )

    def _pin(self, pin: _Pinned, buffers: list[tuple[str, Buffer, bool]]) -> tuple[list[int], int]:
        """Addresses of all buffers and their common length, checked."""
        addrs, lengths = [], []
        for what, obj, writable in buffers:
            addr, length = pin.add(obj, writable, what)
            addrs.append(addr)
            lengths.append((what, length))
        n = lengths[0][1] if lengths else 0
        odd = [f"{what}={length}" for what, length in lengths if length != n]
        if odd:
            raise ValueError(
                f"{self!r}: all fragments must have one length, got {lengths[0][0]}={n} but "
                f"{', '.join(odd)}"
            )
        if n < ALIGN:
            raise ValueError(f"{self!r}: fragments must be at least {ALIGN} bytes, got {n}")
        return addrs, n


def self_test() -> None:
    """Encode, drop m fragments (data ones, so decoding inverts), decode and compare, for k=2, m=1
    and k=4, m=2: a start-up check that the loaded ISA-L computes what we expect."""
    for k, m in ((2, 1), (4, 2)):
        code = Code(k, m)
        image = os.urandom(3 * ALIGN + 1)
        f = code.fragment_len(len(image))
        padded = image + bytes(k * f - len(image))
        frags = [padded[i * f : (i + 1) * f] for i in range(k)] + [bytearray(f) for _ in range(m)]
        code.encode(frags[:k], frags[k:])
        lost = list(range(m))
        have = {i: frags[i] for i in range(k + m) if i not in lost}
        want = {i: bytearray(f) for i in lost + [k + m - 1]}  # the lost data and one parity again
        code.decode(have, want)
        if any(bytes(want[i]) != bytes(frags[i]) for i in want):
            raise StrataError(
                f"erasure coding self-test failed: k={k}, m={m} did not rebuild the "
                f"dropped fragments with ISA-L at {library_path()}"
            )
