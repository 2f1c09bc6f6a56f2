"""`strata plan`: predict each rank's memory (by kind and tier) and the step time of a layout on a
cluster, and search the layouts that fit for the fastest. `cluster` describes the machines,
`shapes` derives sizes from the config, `memory` and `timing` are the two models, `search`
enumerates layouts, `calibrate` measures this machine, `report` prints the tables.
"""
