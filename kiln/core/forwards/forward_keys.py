"""Forward keys: what determines a compiled forward's code, hashed.

A key hashes the graph (model config, tp, the fingerprint of the code that
shapes the package: kiln.host.compile.key_sources, and the TORCHINDUCTOR_* settings
the compile workers inherit: kiln.host.compile.inductor_options.inductor_env), the
package layout (kiln.core.model.contract.LAYOUT: how the constants are stacked, so a
package of another layout is never loaded as this one), the input specs, the
compiler options, the torch version, the target and, when kernel tuning is on,
the digest of the tuned kernel choices the forward compiles with. Not the
weights (they are loaded at run time), not the KV page count (a dynamic
dimension) and not the code that only schedules compiles, so every rank of an
export shares one artifact per forward, a new KV plan reuses every forward and
an edit to the compile pool or to a message compiles nothing again. A forward
covers a range of shapes (kiln.core.forwards.shape_ranges): its key hashes the range's
bounds and its hint (the shape it is compiled for), not any one bucket, so the
same range compiled for another hint is another forward.
Pure: no torch import.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from kiln.core.model.contract import LAYOUT
from kiln.core.forwards.shape_ranges import ShapeRange

KEY_HEX_CHARS = 32


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def digest(obj, chars: int = KEY_HEX_CHARS) -> str:
    """sha256 of the canonical JSON of `obj`, truncated to `chars` hex characters."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:chars]


@dataclass(frozen=True)
class ForwardSpec:
    """Everything a compile worker needs to build one forward, and nothing else."""

    key: str
    shapes: ShapeRange
    """The batch and token ranges the forward takes and the hint it is compiled for."""
    target: str
    graph: dict
    """Model config (as config.json), tp, the code fingerprint (kiln.host.compile.key_sources) and, from a probe,
    'inductor_env': the TORCHINDUCTOR_* settings the compile workers inherit."""
    inputs: dict
    """The forward's input dims: 'batch' and 'tokens' as [min, max], 'hint' [batch, tokens], the pages' sizes;
    the page count is dynamic."""
    compiler: dict
    """Inductor options that change the generated code."""
    tuning: dict | None = None
    """With kernel tuning: {'digest', 'objects': [{'key', 'sha256'}], 'missing'} (see kiln.host.compile.tuner.lookup)."""

    def to_dict(self) -> dict:
        return {"key": self.key, "shapes": str(self.shapes), "target": self.target,
                "graph": self.graph, "inputs": self.inputs, "compiler": self.compiler, "tuning": self.tuning}


def forward_spec(*, shapes: ShapeRange, graph: dict, target: str, torch_version: str,
                 page_tokens: int, pages_per_seq: int, compiler: dict, tuning: dict | None = None) -> ForwardSpec:
    """The spec of the forward over `shapes` with its key.

    `tuning` None (tuning off) leaves the key as without tuning; otherwise its
    'digest' (None while results are missing: a provisional key) is hashed in.
    """
    inputs = {"batch": list(shapes.batch), "tokens": list(shapes.tokens), "hint": [shapes.hint.batch, shapes.hint.tokens],
              "page_tokens": page_tokens,
              "pages_per_seq": pages_per_seq, "num_pages": "dynamic"}
    hashed = {"graph": graph, "layout": LAYOUT, "inputs": inputs, "compiler": compiler, "torch": torch_version,
              "target": target}
    if tuning is not None:
        hashed["tuning"] = tuning.get("digest") or "pending"
    return ForwardSpec(key=digest(hashed), shapes=shapes, target=target, graph=graph, inputs=inputs,
                       compiler=compiler, tuning=tuning)


def check_export_id(export_id: str) -> str:
    """An export id names a store folder and a local one: letters, digits, '-', '_', '.'; no leading or
    trailing '.', at most 128 characters. BadInput otherwise."""
    from kiln.core.errors import BadInput

    ok = (isinstance(export_id, str) and 0 < len(export_id) <= 128 and export_id.isascii()
          and export_id.replace("-", "").replace("_", "").replace(".", "").isalnum()
          and not export_id.startswith(".") and not export_id.endswith("."))
    if not ok:
        raise BadInput(f"export id {export_id!r} may hold only letters, digits, '-', '_' and '.' (not at its "
                       "start or end), at most 128 characters.")
    return export_id
