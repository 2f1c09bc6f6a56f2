"""Checkpoint save/load: atomic, committed checkpoint directories."""
