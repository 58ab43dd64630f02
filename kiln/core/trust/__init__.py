"""Trust and the store's layout: signatures, vouches, the manifest, every object key.

Purpose: `signing` (Ed25519 over a manifest's canonical bytes), `vouch` (a
trusted key's word that a forward key's package has a given sha256),
`signed_record` (measurements later exports act on, signed: worker peaks,
tuning results), `manifest` (built last, checked before use), `layout` (every
store key Kiln writes, built and parsed in one place) and `key_rules` (store
keys and bucket names validated).

Contracts: pure (cryptography is the one library imported); trust comes only
from the verifier's own keys, never from a document's claim about itself.

Pitfalls: anything that ends up signed or acted on must come from a signed
object or be recomputed by the host that uses it.
"""
