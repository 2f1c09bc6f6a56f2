"""The experiment schema: YAML (+ `key.sub=value` overrides) into frozen, validated dataclasses.

This is the one place that parses and checks configuration. Every key has a default and a doc
string (`strata config explain KEY`); `load` reports every problem at once in a ConfigError.

The package, from the bottom up (each module imports only those below it):

- `vocabulary`: the names and arithmetic the layers above share (hierarchy levels, schedules,
  precisions, the parallel layout, the padded vocabulary, offload streams, snapshot fragments);
- `schema`: the frozen dataclasses, one per group of keys, and `Config`; the schema as dotted keys
  (`replace`);
- `checks`: the checks between keys (`cross_problems`), `check_trainable`, `start_up_warnings`;
- `loading`: YAML and overrides into a `Config` (`load`, `from_dict`, `from_yaml`) and back (`to_dict`, `dump`);
- `reference`: `explain`, `all_keys`, `reference_markdown` (docs/CONFIG.md; `python -m strata.config`).

The layers above import what they need from `strata.config.vocabulary` and `strata.config.schema`;
the names below are the package's own surface (the entry points and what code imports from it).
"""

from strata.config import schema
from strata.config.checks import check_trainable, cross_problems, start_up_warnings
from strata.config.loading import (
    _build_group,
    _coerce,
    dump,
    from_dict,
    from_yaml,
    load,
    merge_groups,
    to_dict,
)
from strata.config.reference import all_keys, explain, reference_markdown
from strata.config.schema import *  # noqa: F403 (the whole schema: its __all__)
from strata.config.schema.keys import type_name as _type_name
from strata.config.vocabulary import (
    CHAIN,
    LEVELS,
    OFFLOAD_STREAM_KEYS,
    SINGLE_STAGE_SCHEDULES,
    SLABS_PER_STREAM,
    V_SHAPED_SCHEDULES,
    bpe_problem,
    chain_level,
    layout_problems,
    offload_devices,
    padded_vocab_size,
    pool_streams,
    ranks_per_node,
    snapshot_nodes_problem,
)

__all__ = [
    # the vocabulary
    "CHAIN",
    "LEVELS",
    "OFFLOAD_STREAM_KEYS",
    "SINGLE_STAGE_SCHEDULES",
    "SLABS_PER_STREAM",
    "V_SHAPED_SCHEDULES",
    "bpe_problem",
    "chain_level",
    "layout_problems",
    "offload_devices",
    "padded_vocab_size",
    "pool_streams",
    "ranks_per_node",
    "snapshot_nodes_problem",
    # loading
    "dump",
    "from_dict",
    "from_yaml",
    "load",
    "merge_groups",
    "to_dict",
    # the checks
    "check_trainable",
    "cross_problems",
    "start_up_warnings",
    # the reference
    "all_keys",
    "explain",
    "reference_markdown",
    # internals the tests call directly
    "_build_group",
    "_coerce",
    "_type_name",
]
__all__ += schema.__all__  # the whole schema
