"""Regional compilation (`train.compile`): each transformer block's forward goes through
torch.compile, as torchtitan compiles its blocks. Blocks share their code, so every block of a rank
runs one compiled graph (parameters are its inputs) and the compile time is one block's.

Only the block's own `forward` is compiled. Module hooks stay outside the graph and run eagerly at
every call: the ZeRO engine's gathers and frees, the activation offloader's block markers. A
recomputed block's checkpoint wrapper is compiled with it (torch compiles selective activation
checkpointing's policy into the graph). Layers that talk to other ranks (tensor parallelism's
`COMMUNICATING` layers) run eagerly inside it, so their collectives, byte counters and the hang
watchdog work as without compilation; so does an MoE feed-forward, whose token counts per expert
set its shapes (and whose expert-parallel dispatch communicates); the loss, the embedding and the
output layer stay eager.
"""

from __future__ import annotations

from torch import nn

from strata.model import named_blocks
from strata.moe import MoE
from strata.parallel.tensor import COMMUNICATING


def apply_compile(parts: list[nn.Module]) -> int:
    """Compile every transformer block of `parts` in place (after the other transformations: a
    block's `forward` may already be a recomputation wrapper). Returns how many blocks."""
    # torch.compile pulls in torch._dynamo (about a second): only runs that compile pay it
    import torch

    blocks = 0
    for part in parts:
        for _, block in named_blocks(part):
            for module in block.modules():
                if isinstance(module, (*COMMUNICATING, MoE)):
                    module.forward = torch.compiler.disable(module.forward)  # type: ignore[method-assign]
            block.forward = torch.compile(block.forward)  # type: ignore[method-assign]
            blocks += 1
    return blocks
