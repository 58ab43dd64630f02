"""Where signing and verify keys come from; writing and reading signed manifests.

The signing key of an export, first that applies (decided before any work):

1. `--unsigned` (param `sign: false`): no signature; manifest and report say
   `signed: false`, and `kiln verify` refuses the export unless given
   `--allow-unsigned`.
2. `--signing-key-block NAME`: a Prefect Secret block holding the private key.
3. `KILN_SIGNING_KEY`: the private key itself (PEM, or base64 of the 32-byte seed).
4. A local store (file://): the development key KILN_HOME/keys/dev-signing.key,
   created on first use (mode 0600). It is for this machine only.
5. Otherwise (an S3 store): BadInput, before anything runs, saying how to make a
   key (`kiln keygen DIR`).

The keys `kiln verify` trusts, first that applies: the keys of `--verify-key
FILE` (repeatable), `--verify-key-block NAME` and `KILN_VERIFY_KEY` (exactly
these); else the public half of KILN_SIGNING_KEY and, for a local store, of the
development key; else BadInput. The private key never travels in task
parameters, the job, the store, logs or reports: only its fingerprint does.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kiln.core.trust import signing
from kiln.core.errors import BadInput, IntegrityError, KilnError
from kiln.core.trust.layout import manifest_key, signature_key
from kiln.core.trust.signing import SigningPlan
from kiln.store import LocalStore, ObjectMissing, Store

SIGNING_KEY_ENV = "KILN_SIGNING_KEY"
VERIFY_KEY_ENV = "KILN_VERIFY_KEY"
DEV_KEY_NAME = "dev-signing"
NO_KEY_HELP = ("create a key pair with `kiln keygen DIR`, then set KILN_SIGNING_KEY to the private key "
               "(or store it in a Prefect Secret block and pass --signing-key-block NAME)")


def _write_new(path: Path, data: bytes, mode: int) -> bool:
    """Create `path` with `data` atomically; False (nothing written) if it already exists."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another process created it first
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def keygen(directory: Path | str, name: str = "kiln-signing") -> tuple[Path, Path, str]:
    """Write NAME.key (private PEM, 0600) and NAME.pub into `directory`; return (key, pub, fingerprint)."""
    d = Path(directory).expanduser().resolve()
    key_path, pub_path = d / f"{name}.key", d / f"{name}.pub"
    if key_path.exists() or pub_path.exists():
        raise BadInput(f"{key_path} or {pub_path} already exists; Kiln never overwrites a key. "
                       "Choose another directory or remove the old pair on purpose.")
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = signing.generate()
        _write_new(key_path, signing.private_pem(key), 0o600)
        _write_new(pub_path, signing.public_pem(key.public_key()), 0o644)
    except OSError as exc:
        raise BadInput(f"cannot write a key pair into {d}: {exc.strerror or exc}.") from None
    return key_path, pub_path, signing.fingerprint(key.public_key())


def dev_key(home: Path) -> tuple[Ed25519PrivateKey, Path, bool]:
    """The local development key under KILN_HOME/keys, created if missing: (key, path, created)."""
    d = home / "keys"
    path = d / f"{DEV_KEY_NAME}.key"
    created = False
    try:
        if not path.exists():
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            created = _write_new(path, signing.private_pem(signing.generate()), 0o600)
        key = signing.parse_private_key(path.read_bytes(), source=str(path))
        pub = d / f"{DEV_KEY_NAME}.pub"
        if not pub.exists():
            _write_new(pub, signing.public_pem(key.public_key()), 0o644)
    except OSError as exc:
        raise BadInput(f"cannot create or read the local development signing key {path}: "
                       f"{exc.strerror or exc}; {NO_KEY_HELP}.") from None
    return key, path, created


def _secret_block(name: str) -> str:
    from prefect.blocks.system import Secret

    try:
        value = Secret.load(name).get()
    except ValueError as exc:  # Prefect raises ValueError for a block document it cannot find
        raise BadInput(f"no Prefect Secret block named {name!r} ({type(exc).__name__}); create it with "
                       f"Secret(value=...).save({name!r}) or in the UI.") from None
    if not isinstance(value, str):
        raise BadInput(f"Prefect Secret block {name!r} must hold the key as a string.")
    return value


def _load(plan: SigningPlan, home: Path) -> Ed25519PrivateKey:
    if plan.source == "block":
        return signing.parse_private_key(_secret_block(plan.block), source=f"Prefect Secret block {plan.block!r}")
    if plan.source == "env":
        value = os.environ.get(SIGNING_KEY_ENV, "")
        return signing.parse_private_key(value, source=SIGNING_KEY_ENV)
    if plan.source == "dev":
        return signing.parse_private_key(Path(plan.dev_key_path).read_bytes(), source=plan.dev_key_path)
    raise KilnError(f"signing plan {plan.source!r} has no key")


def plan_signing(*, sign: bool, block: str | None, store: Store, home: Path) -> tuple[SigningPlan, bool]:
    """Decide and check the export's signing key now; (plan, whether a development key was just created)."""
    if not sign:
        if block:
            raise BadInput("--unsigned and --signing-key-block contradict each other; give one of them.")
        return SigningPlan("off"), False
    if block:
        plan = SigningPlan("block", block=block)
    elif os.environ.get(SIGNING_KEY_ENV, "").strip():
        plan = SigningPlan("env")
    elif isinstance(store, LocalStore):
        keys = (home / "keys").resolve()
        if keys == store.root or store.root in keys.parents:
            raise BadInput(f"the local store {store.url} contains KILN_HOME/keys, so the development signing "
                           f"key would live in the store; use another store directory, or {NO_KEY_HELP}.")
        key, path, created = dev_key(home)
        return SigningPlan("dev", signing.fingerprint(key.public_key()), dev_key_path=str(path)), created
    else:
        raise BadInput(f"no signing key for {store.url}: the manifest of an export to a shared store must be "
                       f"signed; {NO_KEY_HELP}. Or pass --unsigned to export without a signature.")
    key = _load(plan, home)
    return SigningPlan(plan.source, signing.fingerprint(key.public_key()), block=plan.block), False


def preview_signing(*, sign: bool, block: str | None, store: Store, home: Path) -> SigningPlan | None:
    """The signing plan `kiln export` would make, for what `kiln plan` trusts (its key's vouches and signed
    measurements), creating nothing: None where deciding it would create the development key or is refused
    (`kiln plan` then trusts only KILN_VERIFY_KEY's keys, as an export with nothing stored of its own would)."""
    dev_missing = not (home / "keys" / f"{DEV_KEY_NAME}.key").exists()
    if sign and not block and not os.environ.get(SIGNING_KEY_ENV, "").strip() and isinstance(store, LocalStore) \
            and dev_missing:
        return None
    try:
        return plan_signing(sign=sign, block=block, store=store, home=home)[0]
    except BadInput:
        return None


def signing_key(plan: SigningPlan, home: Path) -> Ed25519PrivateKey:
    """Load the plan's private key in the process that signs; it must still be the key planned."""
    key = _load(plan, home)
    if signing.fingerprint(key.public_key()) != plan.fingerprint:
        raise KilnError(f"the signing key changed during the export (planned {plan.fingerprint}); "
                        "nothing was signed. Re-run the export.")
    return key


def export_id_taken(store: Store, export_id: str) -> BadInput:
    return BadInput(f"export id {export_id!r} is taken: {store.url}/{manifest_key(export_id)} exists (an export "
                    "finished under it, and a signed export is never overwritten); choose another --export-id "
                    "(the run form's export_id), or leave it empty for a fresh one.")


def check_export_id_free(store: Store, export_id: str) -> None:
    """BadInput (before any work) when the store holds a manifest under `export_id` already."""
    if store.exists(manifest_key(export_id)):
        raise export_id_taken(store, export_id)


def write_signed_manifest(store: Store, export_id: str, manifest: dict, plan: SigningPlan | None,
                          home: Path) -> dict:
    """Write the manifest, then its signature, each create-once; return the report's entry.

    A different manifest stored under `export_id` already is refused (BadInput), never replaced; the same
    one again (a retried write) is no change, its Ed25519 signature neither. A reader that comes between
    the two writes finds a manifest that claims a signature it lacks, and refuses it.
    """
    if plan is None:
        raise KilnError("the export has no signing plan; refusing to write an unsigned manifest silently.")
    entry = manifest.get("signing", {})
    if entry.get("signed") != plan.sign or entry.get("key_fingerprint") != plan.fingerprint:
        raise KilnError("the manifest's signing entry does not match the export's signing plan.")
    signature = signing.sign_manifest(manifest, signing_key(plan, home)) if plan.sign else None  # before any write
    sig_key = signature_key(export_id)
    if not store.exists(manifest_key(export_id)):
        store.delete(sig_key)  # a signature without its manifest is stale (a write that died midway)
    try:
        store.put_json(manifest_key(export_id), manifest)
    except IntegrityError:
        raise export_id_taken(store, export_id) from None
    if signature is not None:
        store.put_json(sig_key, signature)
    return {"signed": plan.sign, "key_fingerprint": plan.fingerprint, "source": plan.source,
            "signature": sig_key if plan.sign else None, "note": plan.describe()}


def export_signer(plan: SigningPlan | None, home: Path, host: str) -> Ed25519PrivateKey | None:
    """The export's signing key where this runs (a compile host, which vouches for what it compiles
    before uploading it: kiln.core.trust.vouch); None for an unsigned export. BadInput naming the host when
    the key cannot be read there, before anything compiles."""
    if plan is None or not plan.sign:
        return None
    try:
        return signing_key(plan, home)
    except (BadInput, OSError) as exc:
        raise BadInput(f"host {host} cannot read the export's signing key ({plan.describe()}): "
                       f"{str(exc).rstrip('.')}. Every host "
                       "that compiles signs what it compiles: give the hosts the key (a Prefect Secret block, "
                       "--signing-key-block, is read by every host; KILN_SIGNING_KEY must be set in each "
                       "host's environment).") from None


def export_trusted_keys(plan: SigningPlan | None, home: Path) -> dict[str, Ed25519PublicKey]:
    """fingerprint -> public key whose vouches an export accepts for forwards it reuses: its own signing
    key and the keys of KILN_VERIFY_KEY. Empty for an unsigned export without KILN_VERIFY_KEY (it then
    reuses nothing from the store that it did not compile itself)."""
    keys: dict[str, Ed25519PublicKey] = {}
    if plan is not None and plan.sign:
        own = signing_key(plan, home).public_key()
        keys[signing.fingerprint(own)] = own
    if os.environ.get(VERIFY_KEY_ENV, "").strip():
        keys.update({signing.fingerprint(k): k for k in _verify_key_env()})
    return keys


def _verify_key_env() -> list[Ed25519PublicKey]:
    value = os.environ[VERIFY_KEY_ENV].strip()
    if "-----BEGIN" not in value and not _looks_like_b64(value) and Path(value).expanduser().is_file():
        value = Path(value).expanduser().read_text()
    return _public_keys_from(value, VERIFY_KEY_ENV)


def _public_keys_from(text: str | bytes, source: str) -> list[Ed25519PublicKey]:
    return signing.parse_public_keys(text, source=source)


def trusted_keys(*, files: list[str] = (), block: str | None = None, store: Store,
                 home: Path) -> dict[str, Ed25519PublicKey]:
    """fingerprint -> public key that `kiln verify` accepts signatures from (see module docstring)."""
    keys: list[Ed25519PublicKey] = []
    for f in files:
        try:
            keys += _public_keys_from(Path(f).expanduser().read_bytes(), f"--verify-key {f}")
        except OSError as exc:
            raise BadInput(f"cannot read --verify-key {f}: {exc.strerror or exc}.") from None
    if block:
        keys += _public_keys_from(_secret_block(block), f"Prefect Secret block {block!r}")
    if os.environ.get(VERIFY_KEY_ENV, "").strip():
        keys += _verify_key_env()
    if not keys:
        if os.environ.get(SIGNING_KEY_ENV, "").strip():
            keys.append(signing.parse_private_key(os.environ[SIGNING_KEY_ENV], source=SIGNING_KEY_ENV).public_key())
        dev = home / "keys" / f"{DEV_KEY_NAME}.pub"
        if isinstance(store, LocalStore) and dev.is_file():
            keys += _public_keys_from(dev.read_bytes(), str(dev))
    if not keys:
        raise BadInput("no key to check the manifest's signature with: pass --verify-key FILE (the .pub that "
                       "`kiln keygen` wrote), set KILN_VERIFY_KEY, or name a Prefect Secret block with "
                       "--verify-key-block.")
    return {signing.fingerprint(k): k for k in keys}


def _looks_like_b64(value: str) -> bool:
    return all(signing.decode_b64_32(line.strip().encode()) is not None
               for line in value.replace(",", "\n").splitlines() if line.strip())


def read_verified_manifest(store: Store, export_id: str, *, trusted, allow_unsigned: bool = False
                           ) -> tuple[dict, str]:
    """The export's manifest after its signature checked out: (manifest as stored, one line on the signature).

    `trusted` is a callable returning the fingerprint -> key map (asked only
    when there is a signature to check). Nothing here downloads or loads an artifact.
    """
    key = manifest_key(export_id)
    try:
        manifest = store.get_json(key)
    except ObjectMissing:
        raise BadInput(f"no export {export_id!r} in {store.url} (no {key}); check the export id and --store.") \
            from None
    except ValueError:
        raise IntegrityError(f"{store.url}/{key} is not JSON; refusing the export.") from None
    try:
        signature = store.get_json(signature_key(export_id))
    except ObjectMissing:
        signature = None
    except ValueError:
        raise IntegrityError(f"{store.url}/{signature_key(export_id)} is not JSON; refusing the export.") from None
    what = f"the manifest of export {export_id}"
    if signature is None:
        if not allow_unsigned:
            raise IntegrityError(
                f"{what} is not signed ({signature_key(export_id)} is missing); refusing to load anything from "
                "it. Export again with a signing key, or pass --allow-unsigned if it was exported with "
                "--unsigned on purpose.")
        if isinstance(manifest, dict) and manifest.get("signing", {}).get("signed") is not False:
            raise IntegrityError(f"{what} says it was signed but its signature is missing; refusing the export.")
        return manifest, "signature: none (unsigned export accepted because of --allow-unsigned)"
    fp = signing.verify_manifest(manifest, signature, trusted(), what=what)
    if manifest.get("signing", {}).get("key_fingerprint") != fp:
        raise IntegrityError(f"{what} names another signing key than the one that signed it; refusing the export.")
    return manifest, f"signature ok: signed by {fp}"
