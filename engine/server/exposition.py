"""Prometheus text for the engine's stats families, written without prometheus_client's per-scrape objects.

Every EPP scrapes every replica 20 times a second, and on a `--backend sim` server the scrape shares the GIL
with the engine loop. prometheus_client's `generate_latest` builds a family object and a sample tuple per value
and validates and escapes every name on every call, which makes it most of a filtered scrape's server CPU. The
families here are fixed (names, help, label names: `FamilySpec`), so their header lines and label names are
formatted once and a scrape only formats the values. The bytes are prometheus_client's:
tests/server/test_exposition.py compares them with `generate_latest` over the same families, whole and narrowed
by `name[]`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

# Names the text format takes unescaped (prometheus_client escapes nothing in them either)
_LEGACY_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LEGACY_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
MAX_PREFIXES = 64  # formatted label sets kept per family


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def escape_label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


@dataclass(frozen=True)
class FamilySpec:
    """One metric family: its name (a counter's without `_total`), type, help text and label names."""

    name: str
    kind: str  # "gauge" | "counter"
    help: str
    labels: tuple[str, ...] = ("model_name",)
    sample_name: str = field(init=False)
    header: str = field(init=False)  # the # HELP and # TYPE lines
    label_order: tuple[int, ...] = field(init=False)  # label indices sorted by name, as the text format orders them
    # label values -> the sample line up to its value: a family's label values rarely change between scrapes
    prefixes: dict = field(init=False, default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in ("gauge", "counter"):
            raise ValueError(f"{self.name}: kind {self.kind!r}")
        sample = self.name + "_total" if self.kind == "counter" else self.name
        if not _LEGACY_NAME.match(sample) or not all(_LEGACY_LABEL.match(label) for label in self.labels):
            raise ValueError(f"{self.name}: a name the text format would escape")
        object.__setattr__(self, "sample_name", sample)
        object.__setattr__(self, "header", f"# HELP {sample} {_escape_help(self.help)}\n# TYPE {sample} {self.kind}\n")
        object.__setattr__(self, "label_order", tuple(sorted(range(len(self.labels)), key=self.labels.__getitem__)))

    def sample_line(self, label_values: tuple[str, ...], value: float) -> str:
        prefix = self.prefixes.get(label_values)
        if prefix is None:
            labels = ",".join(f'{self.labels[i]}="{escape_label_value(label_values[i])}"' for i in self.label_order)
            prefix = f"{self.sample_name}{{{labels}}} " if labels else f"{self.sample_name} "
            if len(self.prefixes) >= MAX_PREFIXES:  # bounded: label values that change every scrape only evict
                self.prefixes.clear()
            self.prefixes[label_values] = prefix
        return f"{prefix}{floatToGoString(value)}\n"


Family = tuple[FamilySpec, Sequence[tuple[tuple[str, ...], float]]]  # a spec and its samples (label values, value)


def render(families: Iterable[Family], names: frozenset[str] | None = None) -> str:
    """The families as the text format, as prometheus_client writes them: whole (`names` None: every family, with
    or without samples), or narrowed to the families whose sample name is in `names` and that have samples (its
    restricted registry's `name[]` filter)."""
    out: list[str] = []
    for spec, samples in families:
        if names is not None and (not samples or spec.sample_name not in names):
            continue
        out.append(spec.header)
        out.extend(spec.sample_line(values, value) for values, value in samples)
    return "".join(out)
