"""Forward shapes: the range of (batch, tokens) one compiled forward takes, and how buckets become ranges. Pure.

A forward is compiled once for a `ShapeRange`: batch in [batch_min, batch_max]
and tokens in [tokens_min, tokens_max], with a `hint`, the one shape of the
range Inductor sizes its kernels for (the example inputs the graph is traced
at). A dimension whose bounds differ is a torch.export `Dim`; one whose bounds
are equal is static, and a range static in both is one bucket's static forward.

Spelled `BxT` (static), `B0-B1xT0-T1` (a range; `2-64x1`: batches 2 to 64 of
one token) and optionally `@BxT` for its hint (`2-64x1@16x1`); the hint
defaults to the range's largest shape (`default_hint`). A dynamic dimension
starts at 2 or more: torch.export assumes a traced dimension is never 0 or 1,
and the package it compiles refuses size 1 (measured: 'dim value is too small
... expected it to be >= 2'; torch's size-oblivious tracing, which would keep 1,
breaks Inductor's scan lowering), so size 1 gets a static forward of its own.

The serving engine still lists its buckets (the recipe's `buckets`); the
recipe's `forward_shapes` gives ranges (and static shapes) directly, and
`shape_policy` groups the buckets they do not hold (`group_buckets`): 'ranges'
makes one decode range (every 1-token bucket, over their batches) and one
prefill range (the rest, over their batches and tokens), each with its batch-1
buckets split off (one static 1x1, one range over batch 1's tokens): at most
four forwards for any bucket list. 'static' makes one static forward per bucket.

When several forwards hold a shape, a consumer picks with `choose_forward`,
the one rule docs/run-without-kiln.md states: the forward whose range holds the
fewest shapes (so a static forward wins over any range that holds its shape),
then the one whose hint is nearest, then the smallest name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kiln.core.errors import BadInput

@dataclass(frozen=True, order=True)
class Bucket:
    """One input shape class the serving engine needs: `batch` sequences of `tokens` new tokens."""

    batch: int
    tokens: int

    def __str__(self) -> str:
        return f"{self.batch}x{self.tokens}"


BUCKET_PATTERN = r"^\s*[1-9]\d*\s*[xX]\s*[1-9]\d*\s*(,\s*[1-9]\d*\s*[xX]\s*[1-9]\d*\s*)*$"
"""What the text of `buckets` looks like (the run form checks it before a run is created)."""


def parse_buckets(spec: str) -> tuple[Bucket, ...]:
    """Parse `BxT,BxT,...` into sorted, distinct buckets; BadInput on anything else."""
    if not isinstance(spec, str) or not spec.strip():
        raise BadInput("buckets is empty; give at least one bucket as BATCHxTOKENS, e.g. 1x16,4x64.")
    out = set()
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", part)
        if not m or int(m[1]) <= 0 or int(m[2]) <= 0:
            raise BadInput(f"bucket {part.strip()!r} is not BATCHxTOKENS with positive integers; "
                           "write buckets like 1x16,4x64.")
        out.add(Bucket(int(m[1]), int(m[2])))
    return tuple(sorted(out))


SHAPE_POLICIES: tuple[str, ...] = ("ranges", "static")

_DIM = r"[1-9]\d*(?:\s*-\s*[1-9]\d*)?"
_ONE = rf"\s*{_DIM}\s*[xX]\s*{_DIM}\s*(?:@\s*[1-9]\d*\s*[xX]\s*[1-9]\d*\s*)?"
SHAPES_PATTERN = rf"^(?:\s*|{_ONE}(?:,{_ONE})*)$"
"""What the text of `forward_shapes` looks like (empty: none given)."""


@dataclass(frozen=True, order=True)
class ShapeRange:
    """The shapes one forward takes: batch in `batch` = (min, max), tokens in `tokens` = (min, max), compiled
    for `hint` (a shape of the range); a dynamic dimension starts at 2 or more."""

    batch: tuple[int, int]
    tokens: tuple[int, int]
    hint: Bucket

    def __post_init__(self) -> None:
        for what, (lo, hi), at in (("batch", self.batch, self.hint.batch), ("tokens", self.tokens, self.hint.tokens)):
            if not 1 <= lo <= hi:
                raise BadInput(f"forward shapes {self}: its {what} range {lo}-{hi} is empty or below 1; write "
                               "MIN-MAX with 1 <= MIN <= MAX.")
            if not lo <= at <= hi:
                raise BadInput(f"forward shapes {self}: its hint {self.hint} lies outside its {what} range "
                               f"{lo}-{hi}; give a hint inside the range (or none: its largest shape).")
            if lo < hi and lo < 2:
                raise BadInput(f"forward shapes {self}: its dynamic {what} range starts at 1, but a package "
                               f"compiled over a range refuses {what} 1 (torch.export assumes a traced dimension "
                               f"is never 0 or 1); start the range at 2 and give {what} 1 a static forward "
                               "(e.g. 1x1,2-64x1).")

    @property
    def static(self) -> bool:
        """Whether this is one bucket's static forward (no dynamic dimension)."""
        return self.batch[0] == self.batch[1] and self.tokens[0] == self.tokens[1]

    @property
    def num_shapes(self) -> int:
        return (self.batch[1] - self.batch[0] + 1) * (self.tokens[1] - self.tokens[0] + 1)

    def holds(self, bucket: Bucket) -> bool:
        return self.batch[0] <= bucket.batch <= self.batch[1] and self.tokens[0] <= bucket.tokens <= self.tokens[1]

    def checked_shapes(self) -> tuple[Bucket, ...]:
        """The shapes a check compares with eager (distinct, sorted): the range's four corners, its hint and
        one interior shape (an odd batch and an odd token count strictly inside each dynamic dimension where
        one exists), so neither an off-diagonal corner nor a shape between the compiled ones goes unchecked."""
        shapes = {Bucket(b, t) for b in self.batch for t in self.tokens} | {self.hint}
        shapes.add(Bucket(_interior(self.batch), _interior(self.tokens)))
        return tuple(sorted(shapes))

    def to_dict(self) -> dict:
        """What a manifest's forward states: {'shapes': name, 'batch': [min, max], 'tokens': [min, max],
        'hint': [batch, tokens]}."""
        return {"shapes": str(self), "batch": list(self.batch), "tokens": list(self.tokens),
                "hint": [self.hint.batch, self.hint.tokens]}

    def __str__(self) -> str:
        if self.static:
            return str(self.hint)
        dims = "x".join(f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in (self.batch, self.tokens))
        return f"{dims}@{self.hint}"


def _interior(bounds: tuple[int, int]) -> int:
    """An odd value strictly between `bounds` (the one nearest their middle), else any value strictly between,
    else the lower bound (a static or two-value dimension has no interior)."""
    lo, hi = bounds
    inside = range(lo + 1, hi)
    if not inside:
        return lo
    middle = (lo + hi) // 2
    odd = [v for v in inside if v % 2]
    return min(odd, key=lambda v: (abs(v - middle), v)) if odd else middle


def static_shape(bucket: Bucket) -> ShapeRange:
    """The static forward of one bucket."""
    return ShapeRange((bucket.batch, bucket.batch), (bucket.tokens, bucket.tokens), bucket)


def default_hint(batch: tuple[int, int], tokens: tuple[int, int]) -> Bucket:
    """A range's hint when none is given: its largest shape, the step that costs the most."""
    return Bucket(batch[1], tokens[1])


def span(batch: tuple[int, int], tokens: tuple[int, int], hint: Bucket | None = None) -> ShapeRange:
    """The range of these bounds, with `hint` or the default one."""
    return ShapeRange(batch, tokens, hint or default_hint(batch, tokens))


def parse_shape_range(text: str) -> ShapeRange:
    """`BxT`, `B0-B1xT0-T1` or either with `@BxT` (the hint); BadInput naming the text otherwise.
    `B0-B1` with B0 = B1 is a static dimension."""
    m = re.fullmatch(r"\s*(\d+)(?:\s*-\s*(\d+))?\s*[xX]\s*(\d+)(?:\s*-\s*(\d+))?\s*(?:@\s*(\d+)\s*[xX]\s*(\d+)\s*)?",
                     text)
    if not m:
        raise BadInput(f"forward shapes {text.strip()!r} are not BxT, B0-B1xT0-T1 or either with @BxT (the hint); "
                       "write them like 1x1,2-64x1@16x1,1x16-256.")
    b0, b1, t0, t1, hb, ht = (None if g is None else int(g) for g in m.groups())
    batch, tokens = (b0, b1 if b1 is not None else b0), (t0, t1 if t1 is not None else t0)
    return span(batch, tokens, None if hb is None else Bucket(hb, ht))


def parse_shape_ranges(text: str) -> tuple[ShapeRange, ...] | None:
    """Comma-separated forward shapes, sorted and distinct; None for empty text (none given)."""
    if not text.strip():
        return None
    return tuple(sorted({parse_shape_range(part) for part in text.split(",")}))


def show_shape_ranges(ranges: tuple[ShapeRange, ...]) -> str:
    return ",".join(map(str, ranges))


def _bounds(buckets: list[Bucket]) -> ShapeRange:
    return span((min(b.batch for b in buckets), max(b.batch for b in buckets)),
                (min(b.tokens for b in buckets), max(b.tokens for b in buckets)))


def group_buckets(buckets: tuple[Bucket, ...], policy: str,
                  given: tuple[ShapeRange, ...] | None = None) -> tuple[ShapeRange, ...]:
    """The forwards of an export: the `given` shapes, then the buckets none of them holds grouped by `policy`
    ('ranges': the 1-token buckets in one decode range, the rest in one prefill range, each with its batch-1
    buckets apart; 'static': one static forward each). BadInput naming a given shape that holds no bucket (it would compile a forward nothing
    listed asks for)."""
    if policy not in SHAPE_POLICIES:
        raise BadInput(f"shape_policy {policy!r} is not one of {', '.join(SHAPE_POLICIES)}.")
    given = tuple(given or ())
    for r in given:
        if not any(r.holds(b) for b in buckets):
            raise BadInput(f"forward shapes {r} hold none of the buckets ({', '.join(map(str, buckets))}); add the "
                           "shapes the server runs there to buckets, or drop that entry from forward_shapes.")
    rest = [b for b in buckets if not any(r.holds(b) for r in given)]
    if policy == "static":
        grouped = [static_shape(b) for b in rest]
    else:
        groups = [[b for b in rest if (b.tokens == 1) == decode and (b.batch == 1) == single]
                  for decode in (True, False) for single in (True, False)]
        grouped = [_bounds(group) for group in groups if group]
    return tuple(sorted({*given, *grouped}))


def choose_forward(ranges, bucket: Bucket):
    """The forward (a ShapeRange, or anything with a `shapes` ShapeRange) to run `bucket` with: among those
    whose range holds it, the fewest shapes, then the hint nearest to it, then the smallest name. ValueError
    when none holds it."""
    def shapes(r) -> ShapeRange:
        return r if isinstance(r, ShapeRange) else r.shapes

    fits = [r for r in ranges if shapes(r).holds(bucket)]
    if not fits:
        raise ValueError(f"no forward takes {bucket} (batch x tokens)")
    return min(fits, key=lambda r: (shapes(r).num_shapes,
                                    abs(shapes(r).hint.batch - bucket.batch) + abs(shapes(r).hint.tokens - bucket.tokens),
                                    str(shapes(r))))
