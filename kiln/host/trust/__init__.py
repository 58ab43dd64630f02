"""Trust on a host: which key signs and which keys are trusted, signed manifests, packages checked before use.

Purpose: `signers` (the export's signing key and `kiln verify`'s trusted keys:
files, environment, a Prefect Secret block; writing and reading signed
manifests), `package_check` (a compiled package's zip members checked
before anything extracts it; whether its wrapper runs Python-free) and `pinned`
(`kiln verify --pin`: a verified export copied into a private folder for the
consumers outside Kiln).

Contracts: trust comes from the keys a user configured, never from what the
store says of itself; a package is native code, checked before it is loaded.
"""
