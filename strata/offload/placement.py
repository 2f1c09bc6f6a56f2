"""Deep Optimizer States (arXiv 2410.21316): where each sub-group of the offloaded optimizer state
is updated, CPU or GPU, chosen by a pure performance model (`plan`) over numbers measured once at
start-up (`calibrate`); docs/design/offload.md §5.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from strata.parallel.runtime import pin_host, unpin_host

FORCES = ("auto", "cpu", "gpu")
MEMORY_MARGIN = 0.10  # of the free GPU memory, left to the allocator and everything else
# Adam's hyper-parameters do not change its speed; these only keep the synthetic state finite.
_ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)


@dataclass(frozen=True)
class Measured:
    """The model's inputs: link bandwidths in bytes/s, Adam throughputs in fp32 elements/s."""

    cuda: bool  # False: no CUDA device, so everything is updated on the CPU
    b_h2d: float = 0.0  # pinned host -> device
    b_d2h: float = 0.0  # device -> pinned host
    r_cpu: float = 0.0  # fused AdamW on the CPU
    r_gpu: float = 0.0  # fused AdamW on the GPU
    kappa: float = 1.0  # CPU Adam slowdown while a copy streams (0 < kappa <= 1)
    m_free: int = 0  # GPU bytes the update may use
    # bytes moved per element: CPU path down, up; GPU path up, down (the paper's: the gradient
    # down and the parameter up; parameter and both moments each way). An engine whose device
    # already holds fp32 parameters moves other amounts and says so here.
    traffic: tuple[int, int, int, int] = (4, 4, 12, 12)

    def __post_init__(self):
        if not 0.0 < self.kappa <= 1.0:
            raise ValueError(f"kappa={self.kappa} must be in (0, 1]")
        if min(self.b_h2d, self.b_d2h, self.r_cpu, self.r_gpu, self.m_free) < 0:
            raise ValueError(f"negative rate or memory in {self}")
        if self.cuda and min(self.b_h2d, self.b_d2h, self.r_cpu, self.r_gpu) <= 0:
            raise ValueError(f"with CUDA every bandwidth and throughput must be positive: {self}")

    def as_record(self) -> dict:
        """The measurements as plain JSON values for the metrics record."""
        return {
            k: (
                v
                if isinstance(v, bool)
                else list(v)
                if isinstance(v, tuple)
                else int(v)
                if k == "m_free"
                else float(v)
            )
            for k, v in asdict(self).items()
        }


@dataclass(frozen=True)
class Placement:
    """The chosen update placement: which sub-groups step on the GPU, the model's predicted update
    time for it and for all on the CPU, and why."""

    on_gpu: tuple[bool, ...]  # per sub-group, in update order
    predicted_s: float  # the model's update time for this plan
    all_cpu_s: float  # the model's update time with every sub-group on the CPU
    reason: str  # one line: why

    def as_record(self) -> dict:
        """The placement for the metrics record: sub-groups, how many on the GPU, the plan as G/C
        letters, the predicted and all-CPU times, and why."""
        return {
            "sub_groups": len(self.on_gpu),
            "on_gpu": sum(self.on_gpu),
            "plan": "".join("G" if g else "C" for g in self.on_gpu),
            "predicted_s": float(self.predicted_s),
            "all_cpu_s": float(self.all_cpu_s),
            "reason": self.reason,
        }


class _Link:
    """One direction of the host-device link. A copy fills the link's idle time from when its input
    is ready, split across gaps if need be (transfers stream through the host pool in slab-sized
    chunks, so they interleave). Not first-come-first-served in sub-group order: a CPU
    sub-group's param upload waits for CPU Adam, and queueing the next GPU sub-group's upload
    behind it (or a CPU sub-group's gradient behind a GPU write-back) kept every sub-group on
    whichever path the first took; unsplit copies in gaps did little better."""

    def __init__(self, bytes_per_s: float):
        self.rate = bytes_per_s
        self.busy: list[tuple[float, float]] = []  # sorted, disjoint

    def slot(self, ready: float, nbytes: int) -> list[tuple[float, float]]:
        """The pieces of link time a copy of `nbytes` would use; the last ends when it is done."""
        t, left, pieces = ready, nbytes / self.rate, []
        for start, end in self.busy:
            if end <= t:
                continue
            if start > t:
                if start - t >= left:
                    break
                pieces.append((t, start))
                left -= start - t
            t = end
        return pieces + [(t, t + left)]

    def take(self, pieces: list[tuple[float, float]]) -> None:
        """Mark `pieces` (start, end) of link time busy, merged with what already was."""
        merged: list[tuple[float, float]] = []
        for start, end in sorted(self.busy + [p for p in pieces if p[1] > p[0]]):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        self.busy = merged

    @property
    def clock(self) -> float:
        """When the link's last busy piece ends (0 when it has none)."""
        return self.busy[-1][1] if self.busy else 0.0


class _Schedule:
    """List scheduling of the sub-groups in order over four resources: CPU Adam and GPU Adam run
    their sub-groups in order (clocks `cpu`, `gpu`), the two links fill idle time (`_Link`)."""

    def __init__(self, m: Measured):
        self.m = m
        self.cpu = self.gpu = 0.0
        self.h2d, self.d2h = _Link(m.b_h2d), _Link(m.b_d2h)
        # GPU sub-groups: (write-back end, bytes), sorted
        self.in_flight: list[tuple[float, int]] = []

    def cpu_path(self, n: int) -> dict[str, list[tuple[float, float]]]:
        """The intervals of updating the next `n` elements on the CPU: gradient down, CPU Adam,
        parameters up."""
        down, up = self.m.traffic[:2]
        grad = self.d2h.slot(0.0, down * n)
        start = max(self.cpu, grad[-1][1])
        adam = [(start, start + n / (self.m.r_cpu * self.m.kappa))]
        return {"d2h": grad, "cpu": adam, "h2d": self.h2d.slot(adam[-1][1], up * n)}

    def gpu_path(self, n: int) -> dict[str, list[tuple[float, float]]]:
        """The intervals of updating the next `n` elements on the GPU: state up (once device memory
        is free), GPU Adam, state back down."""
        up_bytes, down_bytes = self.m.traffic[2:]
        up = self.h2d.slot(self._memory_free_at(up_bytes * n), up_bytes * n)
        start = max(self.gpu, up[-1][1])
        adam = [(start, start + n / self.m.r_gpu)]
        return {"h2d": up, "gpu": adam, "d2h": self.d2h.slot(adam[-1][1], down_bytes * n)}

    def take(self, path: dict[str, list[tuple[float, float]]], n: int) -> None:
        """Commit `path` (from `cpu_path` or `gpu_path`) for `n` elements: its links' time, its
        Adam's clock, and the device memory a GPU update holds until written back."""
        self.h2d.take(path["h2d"])
        self.d2h.take(path["d2h"])
        if "gpu" in path:
            self.gpu = path["gpu"][-1][1]
            bisect.insort(self.in_flight, (path["d2h"][-1][1], self.m.traffic[2] * n))
        else:
            self.cpu = path["cpu"][-1][1]

    def total(self) -> float:
        """When the last resource is done: the schedule's update time."""
        return max(self.cpu, self.gpu, self.h2d.clock, self.d2h.clock)

    def _memory_free_at(self, need: int) -> float:
        # When the GPU sub-groups not yet written back leave room for `need` (counted as if all
        # overlapped: a bound, never an overcommit); one over m_free (forced) waits for them all.
        held = sum(b for _, b in self.in_flight)
        if need + held <= self.m.m_free:
            return 0.0
        for end, b in self.in_flight:
            held -= b
            if need + held <= self.m.m_free:
                return end
        return self.in_flight[-1][0] if self.in_flight else 0.0


def _schedule(sizes: list[int], m: Measured, mode: str) -> tuple[tuple[bool, ...], float]:
    schedule, on_gpu = _Schedule(m), []
    for n in sizes:
        cpu = schedule.cpu_path(n)
        if mode == "gpu":
            use_gpu = True
        elif mode == "cpu" or m.traffic[2] * n > m.m_free:
            use_gpu = False
        else:  # a path finishes with its last copy; a tie stays on the CPU (no GPU memory)
            use_gpu = schedule.gpu_path(n)["d2h"][-1][1] < cpu["h2d"][-1][1]
        schedule.take(schedule.gpu_path(n) if use_gpu else cpu, n)
        on_gpu.append(use_gpu)
    return tuple(on_gpu), schedule.total()


def plan(sizes: list[int], m: Measured, force: str = "auto") -> Placement:
    """Where to update each sub-group (`sizes`: fp32 elements per sub-group, in update order).

    The model (design note §5): CPU path = gradient D2H (4n bytes), CPU Adam (n/(r_cpu·κ)), param
    H2D (4n); GPU path = p, m, v H2D (12n), GPU Adam (n/r_gpu), p, m, v D2H (12n), holding 12n
    bytes of GPU memory from its upload to the end of its write-back. In sub-group order, each takes
    the path that finishes it earlier given what is scheduled so far (Adam runs in order on each
    device; a copy fills its link's idle time once its input is ready); a sub-group over
    m_free stays on the CPU, and all-CPU is kept if the mix is predicted slower. The prediction
    (when the last resource falls idle) assumes the executor issues copies as their inputs become
    ready and holds back an upload until the GPU sub-groups not yet written back leave m_free room
    for it. Without CUDA there are no links: everything runs on the CPU in sum(n)/r_cpu (0 if
    r_cpu is unknown); force="gpu" is still honoured there, so the GPU code path can be tested on
    the CPU.
    """
    if force not in FORCES:
        raise ValueError(f"force={force!r} must be one of {', '.join(FORCES)}")
    if any(n < 0 for n in sizes):
        raise ValueError(f"sub-group sizes must be non-negative: {sizes}")
    count = len(sizes)
    if not m.cuda:
        t = sum(sizes) / m.r_cpu if m.r_cpu > 0 else 0.0
        if force == "auto":
            return Placement(
                (False,) * count, t, t, f"no CUDA device: all {count} sub-groups on the CPU"
            )
        where = "on the CPU" if force == "cpu" else "on the GPU path, run on the CPU"
        return Placement(
            (force == "gpu",) * count,
            t,
            t,
            f"forced: all {count} sub-groups {where} (no CUDA device)",
        )

    _, all_cpu_s = _schedule(sizes, m, "cpu")
    on_gpu, t = _schedule(sizes, m, force)
    if force == "cpu":
        return Placement(
            on_gpu, t, all_cpu_s, f"forced: all {count} sub-groups on the CPU, predicted {t:.3g} s"
        )
    # greedy, so it can lose to all-CPU (a few % of random cases)
    if force == "auto" and t > all_cpu_s:
        return Placement(
            (False,) * count,
            all_cpu_s,
            all_cpu_s,
            f"model: all {count} sub-groups on the CPU, "
            f"predicted {all_cpu_s:.3g} s (the greedy mix of {sum(on_gpu)} on the GPU: {t:.3g} s)",
        )
    head = f"forced: all {count}" if force == "gpu" else f"model: {sum(on_gpu)} of {count}"
    too_big = sum(m.traffic[2] * n > m.m_free for n in sizes)
    tail = (
        (
            f"; {too_big} {'need more than' if force == 'gpu' else 'too large for'} the "
            f"{m.m_free / 2**30:.3g} GiB of free GPU memory"
        )
        if too_big
        else ""
    )
    return Placement(
        on_gpu,
        t,
        all_cpu_s,
        f"{head} sub-groups on the GPU, predicted {t:.3g} s vs {all_cpu_s:.3g} s all-CPU{tail}",
    )


# --- calibration ------------------------------------------------------------------------------
def _adam_state(n: int, device: torch.device | str) -> list[list[torch.Tensor]]:
    p, g, m, v = (
        torch.full((n,), x, dtype=torch.float32, device=device) for x in (1.0, 1e-2, 1e-3, 1e-4)
    )
    return [[p], [g], [m], [v], [], [torch.zeros((), dtype=torch.float32, device=device)]]


def _adam_step(state: list[list[torch.Tensor]]) -> None:
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = state
    torch._foreach_add_(steps, 1)
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        steps,
        amsgrad=False,
        maximize=False,
        grad_scale=None,
        found_inf=None,
        **_ADAM,
    )


def _wall_s(fn: Callable[[], None], repeats: int, warm_up_s: float = 0.05) -> float:
    # One call does not warm up the CPU: on the H100 box's host the first 7 calls of a 4M-element
    # Adam ran at 0.7 G elements/s, the next ones at 12 (clocks and caches coming up to speed).
    until = time.perf_counter() + warm_up_s
    fn()
    while time.perf_counter() < until:
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cuda_s(fn: Callable[[], object], repeats: int) -> float:
    # Events on the stream, not wall time around a synchronize: a 4M-element Adam took 80 us on an
    # H100.
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def calibrate(device: torch.device, sample_elems: int = 1 << 22, repeats: int = 3) -> Measured:
    """Measure the model's inputs on this machine (fused AdamW on `sample_elems` fp32 elements,
    median of `repeats` after a warm-up). Without CUDA only the CPU Adam throughput, which is worth
    logging; with CUDA also both links, GPU Adam, κ and the free GPU memory. Pass the sub-group
    size: a sample whose state fits in the CPU's cache overstates r_cpu (on an H100 host 12 G
    elements/s at 4M elements against 5 G at 64M, where memory bandwidth binds)."""
    cpu_state = _adam_state(sample_elems, "cpu")
    t_cpu = _wall_s(lambda: _adam_step(cpu_state), repeats)
    if device.type != "cuda":
        return Measured(cuda=False, r_cpu=sample_elems / t_cpu)

    # Copies of what a GPU-path sub-group of sample_elems moves (p, m, v), pinned the way the host
    # pool pins (cudaHostRegister): if that fails there, these copies are pageable too.
    host = torch.empty(12 * sample_elems, dtype=torch.uint8)
    pinned = pin_host(host)
    try:
        with torch.cuda.device(device):
            b_h2d, b_d2h, t_gpu, kappa = _measure_cuda(device, host, cpu_state, t_cpu, repeats)
            free, _ = torch.cuda.mem_get_info(device)
            # What the caching allocator holds but nobody uses is free to the update as well.
            free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    finally:
        torch.cuda.synchronize(device)
        if pinned:
            unpin_host(host)
    return Measured(
        cuda=True,
        b_h2d=b_h2d,
        b_d2h=b_d2h,
        r_cpu=sample_elems / t_cpu,
        r_gpu=sample_elems / t_gpu,
        kappa=kappa,
        m_free=int(free * (1 - MEMORY_MARGIN)),
    )


def _measure_cuda(
    device: torch.device,
    host: torch.Tensor,
    cpu_state: list[list[torch.Tensor]],
    t_cpu: float,
    repeats: int,
) -> tuple[float, float, float, float]:
    """(b_h2d, b_d2h, GPU Adam seconds, κ); its device tensors are freed on return."""
    nbytes = host.numel()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b_h2d = nbytes / _cuda_s(lambda: dev.copy_(host, non_blocking=True), repeats)
    b_d2h = nbytes / _cuda_s(lambda: host.copy_(dev, non_blocking=True), repeats)
    gpu_state = _adam_state(cpu_state[0][0].numel(), device)
    t_gpu = _cuda_s(lambda: _adam_step(gpu_state), repeats)
    # κ: CPU Adam while uploads stream on a side stream (enough back to back to outlast it even
    # slowed down twice), against CPU Adam alone timed the same way right after a synchronize:
    # compared with the back-to-back t_cpu, waking the idle CPU threads read as contention.
    side = torch.cuda.Stream(device)
    copies = min(16, math.ceil(2 * t_cpu * b_h2d / nbytes) + 1)
    alone: list[float] = []
    contended: list[float] = []
    for _ in range(repeats):
        for times, streaming in ((alone, 0), (contended, copies)):
            torch.cuda.synchronize(device)
            with torch.cuda.stream(side):
                for _ in range(streaming):
                    dev.copy_(host, non_blocking=True)
            start = time.perf_counter()
            _adam_step(cpu_state)
            times.append(time.perf_counter() - start)
    torch.cuda.synchronize(device)
    kappa = min(1.0, statistics.median(alone) / statistics.median(contended))
    return b_h2d, b_d2h, t_gpu, kappa
