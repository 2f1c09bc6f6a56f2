"""Deep Optimizer States placement (strata/offload/placement.py): the pure model with injected numbers,
hand-checked on small cases, and calibration on this machine (the CUDA branch where there is one)."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from strata.offload.placement import Measured, Placement, calibrate, plan

AMPLE = 1 << 40  # GPU memory that never binds


def gpu_box(**kw) -> Measured:
    """A GPU machine with the model's numbers in round units (bytes/s, elements/s)."""
    base = dict(cuda=True, b_h2d=12.0, b_d2h=12.0, r_cpu=1.0, r_gpu=2.0, kappa=1.0, m_free=AMPLE)
    return Measured(**{**base, **kw})


def test_no_cuda_is_all_cpu():
    p = plan([100, 200, 300], Measured(cuda=False, r_cpu=100.0))
    assert p.on_gpu == (False, False, False)
    assert "no CUDA" in p.reason
    assert p.predicted_s == p.all_cpu_s == pytest.approx(600 / 100.0)
    # an uncalibrated CPU-only Measured still plans
    assert plan([5], Measured(cuda=False)).on_gpu == (False,)
    assert plan([], Measured(cuda=False)).on_gpu == ()


def test_fast_links_and_fast_gpu_put_everything_on_the_gpu():
    m = gpu_box(b_h2d=float("inf"), b_d2h=float("inf"), r_cpu=1e9, r_gpu=1e12)
    p = plan([1 << 20] * 12, m)
    assert p.on_gpu == (True,) * 12
    assert p.predicted_s < p.all_cpu_s
    # nothing moves, so the GPU computes back to back and the CPU would too
    assert p.predicted_s == pytest.approx(12 * (1 << 20) / 1e12)
    assert p.all_cpu_s == pytest.approx(12 * (1 << 20) / 1e9)
    assert p.reason.startswith("model: 12 of 12 sub-groups on the GPU")


def test_slow_links_keep_everything_on_the_cpu():
    m = gpu_box(b_h2d=1e3, b_d2h=1e3, r_cpu=1e9, r_gpu=1e12)
    p = plan([1 << 20] * 6, m)
    assert p.on_gpu == (False,) * 6
    assert p.predicted_s == p.all_cpu_s


def test_hand_computed_mix_of_three():
    # n = 1 each. Links 12 B/s: a gradient or param (4 B) takes 1/3 s, p+m+v (12 B) 1 s.
    # CPU Adam 1 / (r_cpu·κ) = 1 / (1·0.5) = 2 s; GPU Adam 1 / 2 = 0.5 s.
    # sg0  CPU: d2h [0,1/3) adam [1/3,7/3) h2d [7/3,8/3) -> 8/3
    #      GPU: h2d [0,1) adam [1,1.5) d2h [1.5,2.5) -> 2.5            GPU
    # sg1  CPU: d2h [0,1/3) (before [1.5,2.5)) adam [1/3,7/3) h2d [7/3,8/3) -> 8/3
    #      GPU: h2d [1,2) adam [2,2.5) d2h [2.5,3.5) -> 3.5           CPU
    # sg2  CPU: d2h [1/3,2/3) adam [7/3,13/3) h2d [13/3,14/3) -> 14/3
    #      GPU: h2d [1,2) (fits before [7/3,8/3)) adam [2,2.5) d2h [2.5,3.5) -> 3.5   GPU
    # step: the d2h link falls idle last, at 3.5.
    # all-CPU: the CPU Adams run back to back from 1/3: ends 7/3, 13/3, 19/3, last upload to 20/3.
    p = plan([1, 1, 1], gpu_box(kappa=0.5))
    assert p.on_gpu == (True, False, True)
    assert p.predicted_s == pytest.approx(3.5)
    assert p.all_cpu_s == pytest.approx(20 / 3)
    assert p.reason == "model: 2 of 3 sub-groups on the GPU, predicted 3.5 s vs 6.67 s all-CPU"


def test_hand_computed_mix_of_two():
    # κ = 1: CPU Adam 1 s. sg0 CPU finishes 1/3+1+1/3 = 5/3 < GPU 1+0.5+1 = 2.5 -> CPU.
    # sg1 CPU: d2h [1/3,2/3), adam waits for the CPU until 4/3 -> 7/3, upload -> 8/3;
    #     GPU: upload [0,1) in the gap before sg0's [4/3,5/3), adam [1,1.5), d2h [1.5,2.5) -> GPU.
    p = plan([1, 1], gpu_box())
    assert p.on_gpu == (False, True)
    assert p.predicted_s == pytest.approx(2.5)
    assert p.all_cpu_s == pytest.approx(8 / 3)


def test_balanced_numbers_give_a_mix_no_slower_than_all_cpu():
    # roughly an H100 over PCIe 4: 25 GB/s each way, CPU Adam 1.5 G/s slowed 20 % by the copies
    m = Measured(
        cuda=True, b_h2d=25e9, b_d2h=25e9, r_cpu=1.5e9, r_gpu=1e11, kappa=0.8, m_free=40 << 30
    )
    p = plan([16 << 20] * 12, m)
    assert 0 < sum(p.on_gpu) < 12
    assert p.predicted_s < p.all_cpu_s
    # all-CPU is bound by CPU Adam: 12 sub-groups back to back, after the first gradient, plus the last upload
    n = 16 << 20
    assert p.all_cpu_s == pytest.approx(4 * n / 25e9 + 12 * n / (1.5e9 * 0.8) + 4 * n / 25e9)


def test_memory_too_small_for_a_sub_group_keeps_it_on_the_cpu():
    m = gpu_box(r_cpu=0.01, m_free=12 * 2)  # the GPU is far better, but only 2 elements' p+m+v fit
    p = plan([1, 3, 2], m)
    assert p.on_gpu == (True, False, True)
    assert "1 too large" in p.reason
    with_room = plan([1, 3, 2], gpu_box(r_cpu=0.01))
    assert with_room.on_gpu == (True, True, True)
    assert plan([1, 2], gpu_box(r_cpu=0.01, m_free=0)).on_gpu == (False, False)
    forced = plan([1, 2], gpu_box(r_cpu=0.01, m_free=0), force="gpu")
    assert forced.on_gpu == (True, True) and "2 need more than" in forced.reason


def test_memory_for_one_sub_group_serialises_them():
    # Room for one sub-group in flight: sg1's upload waits for sg0's write-back at 3.
    # sg0: h2d [0,1) adam [1,2) d2h [2,3); sg1: h2d [3,4) adam [4,5) d2h [5,6) -> 6
    # (with room: sg1 h2d [1,2) adam [2,3) d2h [3,4) -> 4). CPU Adam takes 100 s, never chosen.
    tight = plan([1, 1], gpu_box(r_cpu=0.01, r_gpu=1.0, m_free=12))
    roomy = plan([1, 1], gpu_box(r_cpu=0.01, r_gpu=1.0))
    assert tight.on_gpu == roomy.on_gpu == (True, True)
    assert tight.predicted_s == pytest.approx(6.0)
    assert roomy.predicted_s == pytest.approx(4.0)


def test_force_is_honoured():
    fast_gpu = gpu_box(b_h2d=1e12, b_d2h=1e12, r_gpu=1e6)
    p = plan([1, 1, 1], fast_gpu, force="cpu")
    assert p.on_gpu == (False,) * 3 and p.predicted_s == p.all_cpu_s
    assert p.reason.startswith("forced")
    slow_links = gpu_box(b_h2d=1e-3, b_d2h=1e-3)
    p = plan([1, 1, 1], slow_links, force="gpu")
    assert p.on_gpu == (True,) * 3 and p.predicted_s > p.all_cpu_s
    assert p.reason.startswith("forced")
    # without CUDA "gpu" still runs the GPU code path (on the CPU), and says why
    p = plan([1, 2], Measured(cuda=False, r_cpu=1.0), force="gpu")
    assert p.on_gpu == (True, True)
    assert "forced" in p.reason and "no CUDA" in p.reason
    p = plan([1, 2], Measured(cuda=False, r_cpu=1.0), force="cpu")
    assert p.on_gpu == (False, False) and "forced" in p.reason
    with pytest.raises(ValueError, match="force"):
        plan([1], fast_gpu, force="fastest")


def test_random_plans_respect_memory_and_never_lose_to_all_cpu():
    rng = random.Random(6)
    for _ in range(300):
        m = Measured(
            cuda=True,
            b_h2d=10 ** rng.uniform(0, 2),
            b_d2h=10 ** rng.uniform(0, 2),
            r_cpu=10 ** rng.uniform(-1, 1),
            r_gpu=10 ** rng.uniform(-1, 2),
            kappa=rng.uniform(0.3, 1),
            m_free=rng.choice([AMPLE, 24, 36, 60]),
        )
        sizes = [rng.randint(1, 5) for _ in range(rng.randint(1, 8))]
        p = plan(sizes, m)
        assert len(p.on_gpu) == len(sizes)
        assert p.predicted_s <= p.all_cpu_s
        assert all(12 * n <= m.m_free for n, g in zip(sizes, p.on_gpu) if g)
        # no schedule beats the busiest resource working alone
        cpu_work = sum(n / (m.r_cpu * m.kappa) for n, g in zip(sizes, p.on_gpu) if not g)
        gpu_work = sum(n / m.r_gpu for n, g in zip(sizes, p.on_gpu) if g)
        d2h_work = sum((12 if g else 4) * n / m.b_d2h for n, g in zip(sizes, p.on_gpu))
        assert p.predicted_s >= max(cpu_work, gpu_work, d2h_work) * (1 - 1e-9)


def test_records_are_plain_json():
    m = Measured(
        cuda=True, b_h2d=2.5e10, b_d2h=2.4e10, r_cpu=1.5e9, r_gpu=1e11, kappa=0.9, m_free=1 << 30
    )
    p = plan([1 << 20] * 4, m)
    assert isinstance(p, Placement)
    for record in (m.as_record(), p.as_record()):
        assert json.loads(json.dumps(record)) == record
    assert m.as_record()["m_free"] == 1 << 30 and m.as_record()["cuda"] is True
    assert p.as_record()["sub_groups"] == 4 and p.as_record()["on_gpu"] == sum(p.on_gpu)


def test_measured_rejects_nonsense():
    with pytest.raises(ValueError, match="kappa"):
        Measured(cuda=False, kappa=0.0)
    with pytest.raises(ValueError, match="positive"):
        Measured(cuda=True, r_cpu=1.0, r_gpu=1.0, b_h2d=0.0, b_d2h=1.0)
    with pytest.raises(ValueError, match="non-negative"):
        plan([1, -1], gpu_box())


def test_calibrate_on_the_cpu():
    start = time.perf_counter()
    m = calibrate(torch.device("cpu"))
    assert time.perf_counter() - start < 2.0
    assert m.cuda is False and m.r_cpu > 0
    assert plan([1 << 20] * 2, m).on_gpu == (False, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_calibrate_on_the_gpu():
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.init()
    start = time.perf_counter()
    m = calibrate(device)
    assert time.perf_counter() - start < 5.0
    assert m.cuda is True
    assert min(m.b_h2d, m.b_d2h, m.r_cpu, m.r_gpu) > 0 and 0 < m.kappa <= 1
    assert m.r_gpu > m.r_cpu
    _, total = torch.cuda.mem_get_info(device)
    assert 0 < m.m_free < total
    p = plan([16 << 20] * 8, m)
    assert p.predicted_s <= p.all_cpu_s
    print(m.as_record(), p.reason)
