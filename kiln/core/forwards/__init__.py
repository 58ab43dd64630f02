"""A forward's identity: the shapes it takes and the key that names its compiled code.

Purpose: `shape_ranges` (buckets, ranges of shapes, the one rule for choosing
among forwards that hold a shape) and `forward_keys` (what determines a
compiled forward's code, hashed; never the weights or the KV page count).

Contracts: pure; imports kiln.core.errors and kiln.core.model only.
"""
