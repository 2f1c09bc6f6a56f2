"""What the MoE layers' routing did in a step, for the whole model: each layer's statistics summed
over the step's micro-batches and every rank that routed tokens (data-parallel replicas, the
tensor-parallel ranks' sequence parts, the pipeline stages' layers), the per-layer metrics logged
from them, and DeepSeek-V3's auxiliary-loss-free bias update, which needs the whole batch's load.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.config import Config
from strata.model import moe_layers
from strata.moe import MoE, RoutingStats, update_expert_bias
from strata.parallel import comm
from strata.parallel.topology import Topology
from strata.trainer.hooks import StepHook


class RoutingMonitor(StepHook):
    """Collects the MoE layers' `RoutingStats` after every step (one small all-reduce over dp, tp
    and pp) and updates their expert biases; `record()` gives the metrics of the newest step."""

    def __init__(self, cfg: Config, parts: list[nn.Module], topo: Topology):
        moe = cfg.model.moe
        self.topo, self.num_experts, self.top_k, self.rate = (
            topo,
            moe.num_experts,
            moe.top_k,
            moe.bias_update_rate,
        )
        self.indices = [i for i in range(cfg.model.n_layers) if moe.is_moe_layer(i)]
        self.row = {layer: row for row, layer in enumerate(self.indices)}
        self.layers: list[tuple[int, MoE]] = [pair for part in parts for pair in moe_layers(part)]
        self.totals: torch.Tensor | None = None  # (MoE layers, E + fields) after the newest step

    def start_step(self, step: int) -> None:
        """Clear the layers' statistics for the step's micro-batches."""
        for _, layer in self.layers:
            layer.stats.reset()

    def end_step(self, step: int, updated: bool) -> None:
        """Sum the step's statistics over every rank; with `updated` (the step changed the weights)
        move the expert biases toward balance."""
        width = self.num_experts + len(RoutingStats.FIELDS)
        device = (
            next(iter(self.layers[0][1].parameters())).device
            if self.layers
            else torch.device("cpu")
        )
        totals = torch.zeros(len(self.indices), width, dtype=torch.float64, device=device)
        for index, layer in self.layers:
            totals[self.row[index]] = layer.stats.as_tensor().to(device)
        # tokens routed by other replicas and sequence parts; other stages' layers
        for dim in ("dp", "tp", "pp"):
            comm.all_reduce(totals, self.topo.group(dim), dim=dim)
        self.totals = totals.cpu()
        if updated and self.rate > 0:
            for index, layer in self.layers:
                update_expert_bias(
                    layer, self.totals[self.row[index], : self.num_experts], self.rate
                )

    def record(self) -> dict:
        """{"moe": {"layer_N": {...}}, with each MoE layer's load max/mean, dropped fraction and
        auxiliary losses (the mean over its forward calls), and their means over the layers}."""
        if self.totals is None:
            return {}
        E = self.num_experts
        layers = {}
        for index, row in zip(self.indices, self.totals):
            load, (calls, tokens, dropped, aux, seq_aux, z) = row[:E], row[E:].tolist()
            calls = max(calls, 1.0)
            layers[f"layer_{index}"] = {
                "load_max_over_mean": float(load.max() / load.mean()) if load.sum() > 0 else 0.0,
                "dropped_fraction": dropped / max(tokens * self.top_k, 1.0),
                "aux_loss": aux / calls,
                "seq_aux_loss": seq_aux / calls,
                "z_loss": z / calls,
            }
        summary = {
            key: sum(v[key] for v in layers.values()) / len(layers)
            for key in next(iter(layers.values()))
        }
        return {"moe": {**{f"mean_{k}": v for k, v in summary.items()}, **layers}}
