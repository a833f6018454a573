"""metav1.Condition lists: built without timestamps, stamped so that unchanged conditions keep theirs.

Status functions are pure: they take the previous conditions and `now`, and a condition whose status did not
change keeps its lastTransitionTime — so a resync that changes nothing writes an identical status.
"""

from __future__ import annotations

from datetime import datetime, timezone


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, ok: bool | None, reason: str, message: str = "", generation: int | None = None) -> dict:
    """One condition; `ok` None means status Unknown."""
    status = "Unknown" if ok is None else ("True" if ok else "False")
    cond = {"type": type_, "status": status, "reason": reason, "message": message}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def stamp(conditions: list[dict], previous: list[dict] | None, now: str | None = None) -> list[dict]:
    """`conditions` with lastTransitionTime: the previous one's where the status is unchanged, else `now`."""
    before = {c.get("type"): c for c in previous or []}
    now = now or utc_now()
    out = []
    for cond in conditions:
        old = before.get(cond["type"])
        since = old.get("lastTransitionTime") if old and old.get("status") == cond["status"] else None
        out.append({**cond, "lastTransitionTime": since or now})
    return out


def find(conditions: list[dict] | None, type_: str) -> dict | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)
