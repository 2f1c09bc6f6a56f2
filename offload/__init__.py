"""Memory tiers (CPU / NVMe offload, issue 6). So far the swap-file I/O engine (`io_engine`) and the host
buffer pool (`pool`); the `offload` config group stays empty until the tiers use them."""
