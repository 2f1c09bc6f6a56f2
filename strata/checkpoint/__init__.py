"""strata.checkpoint: sharded checkpoints in torch.distributed.checkpoint's format that save in
the background and load into any layout, and the worker's side of in-memory snapshots.

Saving: `pieces` (each rank's boxes of the globally named state), `write_plan` and `blob` (who
writes which bytes, as torch.save blobs), `stage` (the rank's file image in shared memory),
`image_check` (a background save's writer checking the image before it writes), `writer`
(persisting it, inline or in a writer process; the commit), `manager` (the training job's
side), `store` (committed step directories), `integrity` (CRC-32C per block), `dcp_meta` (DCP's
`.metadata`). Loading: `reader` (box intersection, reading only the bytes needed) and `layout`
(matching keys and shapes); foreign sources read through the reader's interface: `hf_weights` (a
Hugging Face directory's safetensors) and `dcp_source` (checkpoints DCP wrote alone). Tools behind
`strata ckpt`: `inspect`, `export` (safetensors and Hugging Face; `hf_metadata`: what a Hugging
Face export carries besides the weights), `deepspeed_import`. Snapshots: `snapshot`
(stage, hand to the node's agent, restore), `agent_protocol` (the worker–agent messages),
`channel` (authenticated TCP between agents), `erasure` (ISA-L Reed–Solomon).

It imports the base (`strata`) and `strata.parallel`.
"""

# imported by the top-level link's name, e.g. from the repository root
if __name__ != "strata.checkpoint":
    raise ImportError(
        f"import strata.checkpoint, not {__name__}: the folder checkpoint/ links to "
        "strata/checkpoint/"
    )
