"""A bench flag that names things from a known set, comma-separated: the names, or exit 2 naming what is unknown."""

from __future__ import annotations

from collections.abc import Iterable


def chosen_names(value: str, known: Iterable[str], what: str, command: str) -> list[str]:
    """The names in `value` (comma-separated, blanks dropped), all in `known`; else SystemExit saying which are not
    (or that none was given) and what is known."""
    known = list(known)
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"{command}: {what}: unknown {', '.join(unknown) or '(none given)'} "
                         f"(known: {', '.join(known)})")
    return names
