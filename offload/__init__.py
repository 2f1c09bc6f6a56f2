"""Memory tiers (CPU / NVMe offload). Nothing here yet: the `offload` config group is empty until it lands."""
