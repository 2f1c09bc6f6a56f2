"""Collectives through one door: thin wrappers over torch.distributed that count the bytes each
parallel dimension moves (`bytes_moved`: payload per (dim, op)) and the bytes each rank puts on
the wire per hardware link level (`bytes_by_link`: intra-gpu / intra-node / inter-node, ring
algorithm estimates, each counted on the link to the next member of the ring),
which benchmarks, tests and the run summary read. On a shaped link between network namespaces
these counts agree with the interfaces' TCP payload counters (bench/network.py)."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter

import torch
import torch.distributed as dist

from strata.parallel.watchdog import collective

RedOp = dist.ReduceOp.RedOpType  # what dist.ReduceOp.SUM, .MIN, ... are

bytes_moved: Counter = Counter()
bytes_by_link: Counter = Counter()
_lock = threading.Lock()
_link_of_group: dict = {}  # process group -> the link level its members span (see register_group)
# process group -> the link level of each edge of its ring, in member order
_ring_of_group: dict = {}

# Bytes one rank sends for a collective over n ranks whose local input is `size` bytes, with
# ring algorithms (NCCL's and gloo's defaults): all-reduce = reduce-scatter + all-gather.
_WIRE = {
    "all_reduce": lambda size, n: 2 * (n - 1) * size / n,
    "reduce_scatter": lambda size, n: (n - 1) * size / n,
    "all_gather": lambda size, n: (n - 1) * size,
}


_link_between = None  # (global rank, global rank) -> link level, for point-to-point sends


def register_group(group, link: str, ring: list[str] | None = None) -> None:
    """Record which link level (`parallel.topology.Layout.link_level`) `group` spans and, with
    `ring`, the level of each edge of the ring through its members (`Layout.ring_links`): in a
    ring collective each member sends all its wire bytes to the next member, so in a group that
    spans two nodes only the members before a crossing edge count bytes as inter-node (without
    `ring`: every member does)."""
    _link_of_group[group] = link
    if ring:
        _ring_of_group[group] = ring


def forget_groups() -> None:
    """Drop the link levels of every registered group (before the process groups are destroyed)."""
    _link_of_group.clear()
    _ring_of_group.clear()


def register_link_resolver(resolver) -> None:
    """How to tell the link level between two global ranks (for send/recv accounting)."""
    global _link_between
    _link_between = resolver


# --- simulated slow links (benchmarks, tests): opt-in, off by default --------------------------

# link level -> seconds per wire byte; empty: no delay
_link_delay_s_per_byte: dict[str, float] = {}


def set_link_delay(link: str, seconds_per_byte: float) -> None:
    """Make collectives and sends over `link` ('inter-node', ...) take an extra
    seconds_per_byte · (wire bytes) of wall time, as a slow network would; 0 removes it."""
    if seconds_per_byte > 0:
        _link_delay_s_per_byte[link] = seconds_per_byte
    else:
        _link_delay_s_per_byte.pop(link, None)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _count(
    dim: str, op: str, tensor: torch.Tensor | int, group=None, peer: int | None = None
) -> float:
    """Count an operation's bytes (`tensor`'s, or a byte count): the payload per (dim, op), and
    the wire bytes on the link level that `group` (or the point-to-point `peer`) spans. Returns
    the simulated delay, in seconds, that the operation should add (0 unless `set_link_delay`
    was called)."""
    size = tensor if isinstance(tensor, int) else _nbytes(tensor)
    with _lock:  # CO2's outer all-reduce may count from another thread
        bytes_moved[(dim, op)] += size
    if group is not None:
        link, n = _link_of_group.get(group), dist.get_world_size(group)
    elif peer is not None and _link_between is not None:
        link, n = _link_between(dist.get_rank(), peer), 2
    else:
        return 0.0
    if link is None:
        return 0.0
    wire = int(_WIRE[op](size, n)) if op in _WIRE else size
    ring = _ring_of_group.get(group) if group is not None else None
    if ring:  # a ring collective: this rank sends everything over its edge to the next member
        link_sent = ring[dist.get_rank(group)]
    else:
        link_sent = link
    with _lock:
        bytes_by_link[link_sent] += wire
    return wire * _link_delay_s_per_byte.get(link, 0.0)


def _hold(seconds: float) -> None:
    if seconds:
        time.sleep(seconds)


def all_reduce(
    tensor: torch.Tensor, group, dim: str, op: RedOp = dist.ReduceOp.SUM
) -> torch.Tensor:
    """In-place all-reduce of `tensor` over `group` (no-op without one)."""
    if group is not None:
        delay = _count(dim, "all_reduce", tensor, group)
        with collective("all_reduce", dim):
            dist.all_reduce(tensor, op=op, group=group)
            _hold(delay)
    return tensor


def all_true(flag: bool, group, dim: str) -> bool:
    """Whether `flag` holds on every member of `group` (one small MIN all-reduce)."""
    t = torch.tensor(int(flag))
    all_reduce(t, group, dim, op=dist.ReduceOp.MIN)
    return bool(t)


class AsyncWork:
    """A collective in flight. `wait()` blocks until its result is in the tensor (and, under a
    simulated slow link, until the link would have delivered it); `is_completed()` asks without
    blocking. Without a group the work is complete at once."""

    def __init__(self, work, ready_at: float, name: str = ""):
        self._work, self._ready_at, self._name = work, ready_at, name

    def is_completed(self) -> bool:
        return (
            self._work is None or self._work.is_completed()
        ) and time.monotonic() >= self._ready_at

    def wait(self) -> None:
        with collective(self._name):
            if self._work is not None:
                self._work.wait()
            remaining = self._ready_at - time.monotonic()
            if remaining > 0:
                time.sleep(remaining)


def all_reduce_async(
    tensor: torch.Tensor, group, dim: str, op: RedOp = dist.ReduceOp.SUM
) -> AsyncWork:
    """Start an in-place all-reduce of `tensor` over `group` and return at once; the caller must
    not touch `tensor` until `wait()` returns. Counted like `all_reduce`."""
    if group is None:
        return AsyncWork(None, 0.0)
    ready_at = time.monotonic() + _count(dim, "all_reduce", tensor, group)
    return AsyncWork(
        dist.all_reduce(tensor, op=op, group=group, async_op=True),
        ready_at,
        f"all_reduce over {dim}",
    )


def all_gather(tensor: torch.Tensor, group, dim: str) -> list[torch.Tensor]:
    """Every group member's `tensor` (same shape on all), in group-rank order."""
    if group is None:
        return [tensor]
    delay = _count(dim, "all_gather", tensor, group)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    with collective("all_gather", dim):
        dist.all_gather(parts, tensor.contiguous(), group=group)
        _hold(delay)
    return parts


def all_gather_into_views(
    views: list[torch.Tensor], tensor: torch.Tensor, group, dim: str, async_op: bool = False
) -> AsyncWork | None:
    """Group rank i's `tensor` into `views[i]` (any views, e.g. permuted pieces of one flat
    buffer: no copy-out). With `async_op`, returns the work in flight (wait before reading the
    views). `tensor` must stay unchanged until then; it may be `views[my group rank]` itself.
    Counts the bytes of the local input, as `all_gather` does."""
    if group is None:
        if views[0].data_ptr() != tensor.data_ptr():
            views[0].copy_(tensor)
        return AsyncWork(None, 0.0) if async_op else None
    delay = _count(dim, "all_gather", tensor, group)
    if tensor.device.type == "cpu" and dist.get_backend(group) == "gloo" and _one_link(group):
        work = _exchange_all_gather(views, tensor, group)
    else:
        work = dist.all_gather(
            views, tensor.clone() if async_op else tensor, group=group, async_op=True
        )
    if async_op:
        return AsyncWork(work, time.monotonic() + delay, f"all_gather over {dim}")
    with collective("all_gather", dim):
        work.wait()
        _hold(delay)
    return None


def _one_link(group) -> bool:
    """Whether every edge of `group`'s ring is on the same link level (or nothing is known of it)."""
    return len(set(_ring_of_group.get(group, ()))) <= 1


class _Works:
    """Several point-to-point works waited on as one."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def _exchange(
    sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group
) -> _Works:
    """Point-to-point sends and receives (tensor, global rank) on gloo, every receive posted before
    any send. The order matters on a slow link: two ranks exchanging 10.6 MB over a 100 Mbit/s tbf
    link took 0.88-0.93 s with receives first every time, but 1.76 s (the two directions one after
    the other) in most tries when one side posted its send first (measured with gloo on
    tests/cluster.py's two nodes, three tries of each ordering). Empty tensors are skipped on both sides."""
    works = [dist.irecv(buf, src, group=group) for buf, src in recvs if buf.numel()]
    works += [dist.isend(buf, dst, group=group) for buf, dst in sends if buf.numel()]
    return _Works(works)


def _exchange_all_gather(views: list[torch.Tensor], tensor: torch.Tensor, group) -> _Works:
    """An all-gather on gloo as point-to-point sends straight from `tensor` and receives straight
    into the views, every one posted at once (gloo's transport carries them on its own thread).
    Own code because gloo's all-gather stages the output in a flat buffer of its own and copies it
    out: for a 3 MB buffer over 2 ranks on loopback that took 5.4 ms and 3.5 ms of CPU, this 2.1
    and 1.4 ms; and on a 100 Mbit/s link two ranks' gather of 10.6 MB each took gloo's 1.16-1.35 s,
    this 0.89 s (`_exchange`). Each member sends (n-1)·input, as in a ring; used only where the
    ring's edges all cross one link level, so the bytes counted per level are still what goes over it."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    if views[r].data_ptr() != tensor.data_ptr():
        views[r].copy_(tensor)
    others = [k for k in range(n) if k != r]
    return _exchange(
        [(tensor, ranks[k]) for k in others], [(views[k], ranks[k]) for k in others], group
    )


def reduce_scatter_views_async(
    out: torch.Tensor, views: list[torch.Tensor], group, dim: str
) -> AsyncWork:
    """Start `out` ← the sum over the group of every member's `views[my group rank]` (a
    reduce-scatter whose input chunks may be any views of one buffer; counts the bytes of the whole
    input) and return: `out` holds the result after `wait()`, and neither `out` nor `views` may be
    touched before. On gloo the ring runs before it returns (call it from a thread that may block:
    the reduction lanes of `parallel.overlap` do, and the serial path waits anyway)."""
    if group is None:
        out.copy_(views[0])
        return AsyncWork(None, 0.0)
    ready_at = time.monotonic() + _count(dim, "reduce_scatter", _nbytes(*views), group)
    if dist.get_backend(group) == "gloo":
        with collective("reduce_scatter", dim):  # it runs here and now: the watchdog sees it
            _ring_reduce_scatter(out, views, group)
        return AsyncWork(None, ready_at, f"reduce_scatter over {dim}")
    work = dist.reduce_scatter(out, views, group=group, async_op=True)
    return AsyncWork(work, ready_at, f"reduce_scatter over {dim}")


def _ring_reduce_scatter(out: torch.Tensor, views: list[torch.Tensor], group) -> None:
    """A ring reduce-scatter over send/recv: each member sends (n-1)/n of its input. Own code
    because gloo's reduce_scatter is an all-reduce underneath and puts the whole input on the
    wire (measured on a shaped link: 2 ranks, 32 MB in, 32 MB sent, where 16 MB is the
    minimum): twice the traffic on the links that matter. NCCL's is native and is used as is."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    after, before = ranks[(r + 1) % n], ranks[(r - 1) % n]
    send = views[(r - 1) % n]
    for k in range(n - 1):
        # the last step's sum is ours: made in `out`
        got = out if k == n - 2 else torch.empty_like(views[0])
        _exchange([(send, after)], [(got, before)], group).wait()
        # the chunk the next step passes on; the last is ours
        send = got.add_(views[(r - k - 2) % n])


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def send_tensor(tensor: torch.Tensor, dst: int, dim: str) -> None:
    """Blocking send of a tensor of any shape to global rank `dst`: a header (dtype, ndim,
    shape), then the data. Pair with `recv_tensor`."""
    header = torch.tensor(
        [_DTYPES.index(tensor.dtype), tensor.ndim, *tensor.shape],
        dtype=torch.int64,
        device=tensor.device,
    )  # on the data's device: NCCL sends only GPU tensors
    delay = _count(dim, "send", tensor, peer=dst)
    with collective(f"send to rank {dst}", dim):
        dist.send(torch.tensor([len(header)], dtype=torch.int64, device=tensor.device), dst)
        dist.send(header, dst)
        dist.send(tensor.contiguous(), dst)
        _hold(delay)


def recv_tensor(src: int, device: torch.device, dim: str) -> torch.Tensor:
    """Blocking receive of a tensor sent by `send_tensor` from global rank `src`: the header, then
    the data, into a new tensor on `device`."""
    with collective(f"recv from rank {src}", dim):
        n = torch.empty(1, dtype=torch.int64, device=device)
        dist.recv(n, src)
        header = torch.empty(int(n), dtype=torch.int64, device=device)
        dist.recv(header, src)
        dtype, ndim = _DTYPES[int(header[0])], int(header[1])
        out = torch.empty([int(d) for d in header[2 : 2 + ndim]], dtype=dtype, device=device)
        dist.recv(out, src)
    _count(dim, "recv", out)
    return out


# torch renamed the single-tensor collectives (2.13 deprecates the old names); take whichever
# this torch has, so both >= 2.6 and the newest work without warnings.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_along(tensor: torch.Tensor, group, dim: str, axis: int) -> torch.Tensor:
    """Every group member's `tensor` (same shape on all) concatenated along tensor axis `axis`,
    in group-rank order; returns `tensor` itself without a group. Counts the bytes of the local
    input, as `all_gather` does."""
    if group is None:
        return tensor
    delay = _count(dim, "all_gather", tensor, group)
    size = dist.get_world_size(group)
    front = tensor.movedim(axis, 0).contiguous()  # collectives split/concatenate along dim 0
    out = front.new_empty((size * front.shape[0], *front.shape[1:]))
    with collective("all_gather", dim):
        _all_gather_single(out, front, group=group)
        _hold(delay)
    return out.movedim(0, axis).contiguous()


def reduce_scatter_along(
    tensor: torch.Tensor, group, dim: str, axis: int, op: RedOp = dist.ReduceOp.SUM
) -> torch.Tensor:
    """This member's chunk of the group-wide reduction of `tensor`: the reduced tensor split
    evenly along tensor axis `axis` into group-size chunks, chunk i to group rank i. Returns
    `tensor` itself without a group. Counts the bytes of the (full) input."""
    if group is None:
        return tensor
    size = dist.get_world_size(group)
    if tensor.shape[axis] % size:
        raise ValueError(
            f"reduce_scatter_along: axis {axis} of shape {tuple(tensor.shape)} is not divisible "
            f"by the group size {size}"
        )
    delay = _count(dim, "reduce_scatter", tensor, group)
    front = tensor.movedim(axis, 0).contiguous()
    out = front.new_empty((front.shape[0] // size, *front.shape[1:]))
    with collective("reduce_scatter", dim):
        _reduce_scatter_single(out, front, op=op, group=group)
        _hold(delay)
    return out.movedim(0, axis).contiguous()


def shift_async(
    tensors: list[torch.Tensor], group, dim: str
) -> tuple[list[torch.Tensor], AsyncWork]:
    """Send `tensors` to the next member of `group` (group rank r+1, wrapping) and receive the
    previous member's, of the same shapes, into new tensors: a ring's step, started and returned
    at once (read the received tensors, and touch the sent ones, only after `wait()`). Without a
    group, the tensors themselves. Counts each send on the link to the next member."""
    if group is None:
        return tensors, AsyncWork(None, 0.0)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    after, before = ranks[(r + 1) % n], ranks[(r - 1) % n]
    delay = sum(_count(dim, "send", t, peer=after) for t in tensors)
    sends = [t.contiguous() for t in tensors]
    got = [torch.empty_like(t) for t in sends]
    if sends and sends[0].device.type == "cpu" and dist.get_backend(group) == "gloo":
        work = _exchange([(t, after) for t in sends], [(t, before) for t in got], group)
    else:
        ops = [dist.P2POp(dist.irecv, t, before, group) for t in got]
        ops += [dist.P2POp(dist.isend, t, after, group) for t in sends]
        work = _Works(dist.batch_isend_irecv(ops))
    return got, AsyncWork(work, time.monotonic() + delay, f"ring shift over {dim}")


def all_to_all(
    tensor: torch.Tensor, send_rows: list[int], recv_rows: list[int], group, dim: str
) -> torch.Tensor:
    """Rows [sum(send_rows[:j]), +send_rows[j]) of `tensor` to group rank j; returns the rows every
    member sent this one, in group-rank order (`recv_rows[j]` from rank j). Without a group,
    `tensor` itself. The payload counted is what leaves this rank, and the wire bytes go to the
    link level between this rank and each destination (an expert-parallel exchange between two
    nodes puts only the rows for the other node on the inter-node link)."""
    if group is None:
        return tensor
    tensor = tensor.contiguous()
    row = math.prod(tensor.shape[1:]) * tensor.element_size()
    me = dist.get_rank(group)
    members = dist.get_process_group_ranks(group)
    delay = 0.0
    with _lock:
        bytes_moved[(dim, "all_to_all")] += row * (sum(send_rows) - send_rows[me])
    for j, rows in enumerate(send_rows):
        if j != me and rows and _link_between is not None:
            link = _link_between(dist.get_rank(), members[j])
            with _lock:
                bytes_by_link[link] += rows * row
            delay += rows * row * _link_delay_s_per_byte.get(link, 0.0)
    out = tensor.new_empty((sum(recv_rows), *tensor.shape[1:]))
    with collective("all_to_all", dim):
        if tensor.device.type == "cpu" and dist.get_backend(group) == "gloo":
            # gloo's all_to_all_single sends the two directions of a pair one after the other on a
            # slow link (two ranks, 10.6 MB each way over 100 Mbit/s: 1.48-1.78 s, against 0.89 s as
            # receive-first point-to-point operations)
            ins, outs = tensor.split(send_rows), out.split(recv_rows)
            outs[me].copy_(ins[me])
            others = [j for j in range(len(members)) if j != me]
            _exchange(
                [(ins[j], members[j]) for j in others],
                [(outs[j], members[j]) for j in others],
                group,
            ).wait()
        else:
            dist.all_to_all_single(out, tensor, recv_rows, send_rows, group=group)
        _hold(delay)
    return out


def gather_objects(obj, group, dst: int) -> list | None:
    """Every group member's picklable `obj` at global rank `dst` (None elsewhere). In-process
    control data only (pickled over the wire by torch); not counted, not for hot paths."""
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    with collective("gather_object"):
        dist.gather_object(obj, out, dst=dst, group=group)
    return out


def all_gather_objects(obj, group) -> list:
    """Every group member's picklable `obj`, on every member ([obj] without a group). Control data
    only, like gather_objects: not counted."""
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    with collective("all_gather_object"):
        dist.all_gather_object(out, obj, group=group)
    return out


def world_group():
    """The group of every rank (torch's default), or None in a process without a world."""
    return dist.group.WORLD if dist.is_initialized() else None


def new_gloo_group():
    """A gloo group over the whole world for control messages (a background save's status) kept
    apart from training's collectives. Every rank must call it, in the same order as other groups."""
    return dist.new_group(backend="gloo")


def barrier(group=None) -> None:
    """Wait for every rank of `group` (the world by default); nothing to do without a process group."""
    if dist.is_initialized():
        with collective("barrier"):
            dist.barrier(group=group)
