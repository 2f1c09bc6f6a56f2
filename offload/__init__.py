"""Memory tiers (issue 6; docs/OFFLOAD.md): ZeRO state and activations in host memory or NVMe swap
files, moved through one budgeted host buffer pool. `tiers.Tiers` builds what a config asks for."""
