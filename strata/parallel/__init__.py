"""strata.parallel: how the model and its training state are laid out over the ranks.

`topology` (the only rank arithmetic: named process groups and the hierarchy levels), `comm` (the
only door to collectives, counting bytes per parallel dimension and link level), `watchdog` (hang
detection: each rank's progress and one verdict naming the stuck rank), `runtime` (joining the
world, the device, leaving cleanly, pinned host memory), `tensor` (Megatron's tensor and sequence
parallelism), `experts` (expert parallelism: MoE experts split over ranks, tokens exchanged by
all-to-all), `context` (context parallelism: a sequence split over ranks, attention across it by a
K/V ring or an all-to-all), `stages` (which layers each pipeline stage runs and which stages each
rank holds) and `pipeline` (the stages run by torch.distributed.pipelining schedules), the ZeRO
engine in `zero` with `flat_group` (one flat group's buffers, gathers and gradient reduction),
`routes` (moving state between levels) and `flat` (flat ranges as boxes of tensors) — ZeRO-1/2/3,
hpZ and 3-level partitioning as settings of one engine; plain data parallelism is the engine with
nothing partitioned —, `overlap` (gradient reductions behind backward), `co2` (asynchronous outer
updates across nodes) and `clipping` (the global gradient norm).

It imports only the base, the package `strata`.
"""

# imported by the top-level link's name, e.g. from the repository root
if __name__ != "strata.parallel":
    raise ImportError(
        f"import strata.parallel, not {__name__}: the folder parallel/ links to strata/parallel/"
    )
