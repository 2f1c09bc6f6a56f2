"""Memory tiers (CPU / NVMe offload, issue 6). So far only the swap-file I/O engine (`io_engine`); the `offload` config group stays empty until the tiers land."""
