"""strata.offload: memory tiers (docs/OFFLOAD.md). ZeRO state and activations live in host memory
or NVMe swap files, moved through one budgeted host buffer pool.

`pool` (the pinned host arena), `files`, `io_engine` and `swap` (preallocated swap files, the
O_DIRECT thread pool, transfers in flight), `params` and `optim` (ZeRO-Infinity's parameter and
optimizer tiers), `placement` (Deep Optimizer States: which sub-groups update on the CPU or the
GPU), `activations` (activation offload and recompute), and `tiers` (`Tiers`: builds what a config
asks for over a ZeRO engine, with every start-up check).

It imports the base (`strata`) and `strata.parallel`.
"""

# imported by the top-level link's name, e.g. from the repository root
if __name__ != "strata.offload":
    raise ImportError(
        f"import strata.offload, not {__name__}: the folder offload/ links to strata/offload/"
    )
