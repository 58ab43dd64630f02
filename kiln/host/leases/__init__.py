"""Leases held across processes and hosts: compile leases in the store, the model lease's waiting.

Purpose: `leasing` (compile leases: one host compiles a key, others wait or
take over from a holder provably gone) and `lease_wait` (holding the model
lease: waiting, takeover, keeping the holder record fresh; knows no Prefect).

Contracts: the decisions are kiln.core.run.leases and holders; a holder is
taken over only when provably gone.
"""
