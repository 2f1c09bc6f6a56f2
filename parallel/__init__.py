"""Parallelism: topology and process groups, collectives that count bytes, data parallel."""
