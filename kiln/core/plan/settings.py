"""Recipe settings as data: one declaration per setting, and everything derived from it.

Pure: no torch, prefect or boto3 import (pydantic only when a form model is asked for).
A setting is a dataclass field declared with `setting(...)` (default, doc, unit,
bounds); its type annotation gives its kind, `Literal[...]` its choices and
`X | None` that it may be left unset. From the declarations come:

- `Setting.check`: the validation `Recipe.__post_init__` runs on every value;
- `Setting.parse`: text to a typed value, for the CLI edge (`--NAME VALUE`, `--set NAME=VALUE`);
- `form_model`: a pydantic model (typed fields, defaults, bounds, enums) that the
  deployment's run form and the `Kiln Recipe` block are made of;
- `markdown`: the table of docs/recipe.md.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass
from types import NoneType, UnionType

from kiln.core.errors import BadInput

GROUPS: dict[str, str] = {"layout": "Model and layout", "store": "Store", "memory": "Memory and gate",
                          "compile": "Compile", "checks": "Checks", "advanced": "Advanced"}
"""The run form's sections, in order: key -> heading."""


def setting(default, doc: str, *, unit: str | None = None, ge: float | None = None, gt: float | None = None,
            le: float | None = None, null: str | None = None, parse: Callable[[str], object] | None = None,
            show: Callable[[object], str] | None = None, pattern: str | None = None, example: str | None = None,
            compiling_only: bool = False, title: str | None = None, group: str = "advanced"):
    """Declare one setting: its default, what it means (`doc`), its unit and bounds.

    `null` says what None means, for a setting that may be left unset. A setting
    whose value is not a plain number, flag or choice gives `parse` (text to
    value), `show` (value to text) and the `pattern` its text must match, with an
    `example`. `compiling_only`: the setting matters only when something is compiled (an export
    that finds every forward in the store warns that it had no effect). `title` is the run form's label
    (default: derived from the name); `group` the form section it is listed in (one of GROUPS).
    """
    if group not in GROUPS:
        raise TypeError(f"setting group {group!r} is not one of {', '.join(GROUPS)}")
    meta = {"doc": " ".join(doc.split()), "unit": unit, "ge": ge, "gt": gt, "le": le, "null": null,
            "parse": parse, "show": show, "pattern": pattern, "example": example, "compiling_only": compiling_only,
            "title": title, "group": group}
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Setting:
    """One declared setting. `kind` is 'int', 'float', 'bool', 'choice' or 'text' (parsed by `parser`)."""

    name: str
    kind: str
    default: object
    doc: str
    nullable: bool = False
    choices: tuple[str, ...] = ()
    unit: str | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    null: str | None = None
    parser: Callable[[str], object] | None = None
    shower: Callable[[object], str] | None = None
    pattern: str | None = None
    example: str | None = None
    compiling_only: bool = False
    title: str = ""
    group: str = "advanced"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def show(self, value) -> str:
        """`value` as the text `parse` reads back ('auto' for unset)."""
        if value is None:
            return "auto"
        if self.shower:
            return self.shower(value)
        if isinstance(value, bool):
            return "true" if value else "false"
        return str(value)

    def bounds(self) -> str:
        parts = [f">= {_num(self.ge)}" if self.ge is not None else "",
                 f"> {_num(self.gt)}" if self.gt is not None else "",
                 f"<= {_num(self.le)}" if self.le is not None else ""]
        return " and ".join(p for p in parts if p)

    def expects(self) -> str:
        """What a value looks like, in words."""
        if self.kind == "choice":
            what = "one of " + ", ".join(self.choices)
        elif self.kind == "bool":
            what = "true or false"
        elif self.kind == "int":
            what = "a whole number" + (f" {self.bounds()}" if self.bounds() else "")
        elif self.kind == "float":
            what = "a number" + (f" {self.bounds()}" if self.bounds() else "")
        else:
            what = self.example or "text"
        return what + (" or auto" if self.nullable else "")

    def check(self, value) -> None:
        """BadInput naming the setting, the value and what it takes, unless `value` is one this setting takes."""
        if value is None and self.nullable:
            return
        ok = True
        if self.kind == "bool":
            ok = isinstance(value, bool)
        elif self.kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool) and _within(self, value)
        elif self.kind == "float":
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                  and _within(self, value))
        elif self.kind == "choice":
            ok = value in self.choices
        elif self.kind == "text":
            ok = value is not None and value != ()
        if not ok:
            unit = f" ({self.unit})" if self.unit else ""
            raise BadInput(f"recipe setting {self.name}{unit} must be {self.expects()}, got {value!r}.")

    def parse(self, text: str):
        """The typed value of `text` (from the CLI); BadInput naming the setting and what it takes."""
        raw = str(text).strip()
        if self.nullable and raw.lower() in ("auto", "none", ""):
            return None
        try:
            if self.kind == "bool":
                low = raw.lower()
                if low in ("true", "1", "yes", "on"):
                    return True
                if low in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            if self.kind == "int":
                value = int(raw)
            elif self.kind == "float":
                value = float(raw)
            elif self.kind == "text" and self.parser:
                value = self.parser(raw)
            else:
                value = raw
        except ValueError:
            raise BadInput(f"{self.name}={raw}: expected {self.expects()}.") from None
        self.check(value)
        return value

    def describe(self) -> str:
        """The doc, then unit, bounds and what unset means: the CLI's help and the form's description."""
        extra = []
        if self.unit:
            extra.append(f"unit: {self.unit}")
        if self.bounds():
            extra.append(self.bounds())
        if self.null:
            extra.append(f"auto: {self.null}")
        return self.doc + (f" ({'; '.join(extra)})" if extra else "")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _within(s: Setting, value) -> bool:
    return ((s.ge is None or value >= s.ge) and (s.gt is None or value > s.gt)
            and (s.le is None or value <= s.le))


def settings_of(cls) -> tuple[Setting, ...]:
    """The settings of dataclass `cls`, in declaration order, from its fields and type annotations."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        m = dict(f.metadata)
        if "doc" not in m:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting(...)")
        hint, nullable = hints[f.name], False
        if isinstance(hint, UnionType) or typing.get_origin(hint) is typing.Union:
            args = [a for a in typing.get_args(hint) if a is not NoneType]
            nullable, hint = len(args) < len(typing.get_args(hint)), args[0]
        choices: tuple[str, ...] = ()
        if typing.get_origin(hint) is typing.Literal:
            kind, choices = "choice", tuple(typing.get_args(hint))
        elif hint is bool:
            kind = "bool"
        elif hint is int:
            kind = "int"
        elif hint is float:
            kind = "float"
        elif m["parse"] is not None:
            kind = "text"
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: a {hint} setting needs parse= and show=")
        out.append(Setting(name=f.name, kind=kind, default=f.default, doc=m["doc"], nullable=nullable,
                           choices=choices, unit=m["unit"], ge=m["ge"], gt=m["gt"], le=m["le"], null=m["null"],
                           parser=m["parse"], shower=m["show"], pattern=m["pattern"], example=m["example"],
                           compiling_only=m["compiling_only"], title=m.get("title") or _title(f.name),
                           group=m.get("group", "advanced")))
    return tuple(out)


def parse_assignments(settings: tuple[Setting, ...], items: list[str] | tuple[str, ...]) -> dict:
    """`NAME=VALUE` strings (the CLI's `--set`) as {name: typed value}."""
    by_name = {s.name: s for s in settings}
    out = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or name not in by_name:
            raise BadInput(f"--set {item!r}: expected NAME=VALUE with NAME one of: {', '.join(sorted(by_name))}.")
        out[name] = by_name[name].parse(raw)
    return out


AUTO = "auto"
"""A nullable choice or flag's form value for 'unset' (the CLI's `auto` too)."""


def worded_text(pattern: str, expected: str):
    """A pydantic text type that must match `pattern`, answered in words.

    The JSON schema says it as `if pattern / else const expected`, so a form's
    validation (Prefect's, jsonschema) answers "'<expected>' was expected"
    instead of showing the raw regex; pydantic's error names `expected` too.
    """
    import re
    from typing import Annotated

    from pydantic import AfterValidator, Field

    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if not compiled.search(value):
            raise ValueError(f"{value!r}: {expected}")
        return value

    return Annotated[str, AfterValidator(check),
                     Field(json_schema_extra={"if": {"pattern": pattern}, "else": {"const": expected}})]


def form_description(s: Setting, titles: dict[str, str]) -> str:
    """What the form says under a setting: its doc, other settings named by their form titles, then its
    unit, bounds and what 'auto' (or 0) means, in words."""
    import re

    # Only names written as code (with an underscore): a one-word name (tuning, policy) is also a word.
    named = sorted((n for n in titles if "_" in n), key=len, reverse=True)
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, named)) + r")\b")

    def worded(text: str) -> str:
        return pattern.sub(lambda m: f"'{titles[m[1]]}'", text) if named else text

    text = worded(s.doc)
    extra = []
    if s.bounds() and not (s.nullable and s.kind in ("int", "float")):
        extra.append("must be " + s.bounds().replace(">=", "at least").replace("<=", "at most")
                     .replace(">", "more than"))
    if s.null:
        empty = {"int": "0", "float": "0", "text": "empty"}.get(s.kind, AUTO)
        extra.append(f"{empty}: {worded(s.null)}")
    if s.example:
        extra.append(f"e.g. {s.example}")
    return text + (f" ({'; '.join(extra)})" if extra else "")


def form_model(settings: tuple[Setting, ...], name: str, doc: str, title: str | None = None):
    """A pydantic model with one typed field per setting: default, bounds, enum, title and description.

    Its fields hold what a form or a block can hold, never null (a form renders
    `X | None` as a type switch): text settings (buckets) as their text, checked
    in words; a nullable number as 0 for unset, a nullable flag or choice with an
    'auto' choice. Fields are listed by group (GROUPS), then declaration order;
    `from_form(values)` turns a dump of it back into typed recipe values.
    """
    from typing import Annotated, Literal

    from pydantic import ConfigDict, Field, create_model

    titles = {s.name: s.title for s in settings}
    order = list(GROUPS)
    fields = {}
    for s in sorted(settings, key=lambda s: order.index(s.group)):
        if s.kind == "choice":
            typ = Literal[((AUTO,) if s.nullable else ()) + s.choices]
        elif s.kind == "bool" and s.nullable:
            typ = Literal[AUTO, "yes", "no"]
        elif s.kind == "text":
            typ = worded_text(s.pattern, f"write {s.title.lower()} like {s.example}") if s.pattern else str
        else:
            typ = {"int": int, "float": float, "bool": bool}[s.kind]
        bounds = {k: getattr(s, k) for k in ("ge", "gt", "le") if getattr(s, k) is not None}
        if s.nullable and s.kind in ("int", "float"):
            bounds = {"ge": 0, **({"le": s.le} if s.le is not None else {})}  # 0 stands for unset
        if bounds:
            typ = Annotated[typ, Field(**bounds)]
        fields[s.name] = (typ, Field(form_value(s, s.default), title=s.title,
                                     description=form_description(s, titles)))
    return create_model(name, __doc__=doc, __config__=ConfigDict(extra="forbid", title=title), **fields)


def form_value(s: Setting, value):
    """A typed value as the form holds it (see form_model)."""
    if value is None:
        return {"int": 0, "float": 0.0, "text": ""}.get(s.kind, AUTO)
    if s.kind == "text":
        return s.show(value)
    if s.kind == "bool" and s.nullable:
        return "yes" if value else "no"
    return value


def _title(name: str) -> str:
    """`headroom_floor_mib` -> 'Headroom floor (MiB)': the form's label unless the setting gives one."""
    words = name.split("_")
    unit = {"mib": "MiB", "s": "s"}.get(words[-1]) if len(words) > 1 else None
    if unit:
        words.pop()
    words = ["MiB" if w == "mib" else w.upper() if w in ("kv", "s3", "tp") else w for w in words]
    words[0] = words[0][:1].upper() + words[0][1:]
    return " ".join(words) + (f" ({unit})" if unit else "")


def from_form(settings: tuple[Setting, ...], values: dict) -> dict:
    """{name: typed value} from a form model's dump (text settings parsed, the form's unset values None)."""
    by_name = {s.name: s for s in settings}
    out = {}
    for name, value in values.items():
        s = by_name[name]
        if s.nullable and value in (AUTO, "", None) or (s.nullable and s.kind in ("int", "float") and value == 0):
            out[name] = None
        elif s.kind == "bool" and s.nullable:
            out[name] = value in (True, "yes")
        else:
            out[name] = s.parse(value) if s.kind == "text" else value
    return out


def markdown(settings: tuple[Setting, ...]) -> str:
    """The settings table of docs/recipe.md."""
    rows = ["| setting | type | default | meaning |", "|---|---|---|---|"]
    for s in settings:
        typ = {"choice": " \\| ".join(f"`{c}`" for c in s.choices),
               "text": f"text, e.g. `{s.example}`" if s.example else "text"}.get(s.kind, s.kind)
        if s.unit:
            typ += f" ({s.unit})"
        if s.bounds():
            typ += f", {s.bounds()}"
        default = f"`{s.show(s.default)}`"
        meaning = s.doc.replace("|", "\\|") + (f" Unset (`auto`): {s.null}." if s.null else "") \
            + (" Matters only when something is compiled." if s.compiling_only else "")
        rows.append(f"| `{s.name}` | {typ} | {default} | {meaning} |")
    return "\n".join(rows) + "\n"
