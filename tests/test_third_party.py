"""The repository stands alone: the upstream files its tests check kvgate against are vendored in it, unchanged
(third_party/SHA256SUMS), with their provenance and licenses, and nothing in it points outside the repository."""

import hashlib
import re
import subprocess
from pathlib import Path

import pytest

from tests.upstream import CONFORMANCE, ROOT, THIRD_PARTY, upstream_crds


def test_every_vendored_file_is_there_and_unchanged():
    lines = (THIRD_PARTY / "SHA256SUMS").read_text().splitlines()
    listed = {}
    for line in lines:
        digest, name = line.split(maxsplit=1)
        listed[name.lstrip("*")] = digest
    for name, digest in listed.items():
        path = ROOT / name
        assert path.is_file(), f"{name} is listed in third_party/SHA256SUMS but missing"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, \
            f"{name} differs from the upstream file it was vendored as (see third_party/README.md to update it)"
    vendored = {str(p.relative_to(ROOT)) for p in THIRD_PARTY.rglob("*") if p.is_file()
                and p.name not in ("README.md", "SHA256SUMS")}
    vendored |= {str(p.relative_to(ROOT)) for p in CONFORMANCE.iterdir() if p.name != "README.md"}
    assert vendored == set(listed), "every vendored file has a checksum, and only those"
    for path in upstream_crds():
        assert (path.parent / "LICENSE").is_file(), f"{path.parent} carries its upstream license"


def test_the_provenance_table_names_each_folder_and_commit():
    readme = (THIRD_PARTY / "README.md").read_text()
    for folder in ("gateway-api/", "gateway-api-inference-extension/", "conformance/manifests/"):
        assert f"`{folder}`" in readme or f"`../{folder}`" in readme, folder
    assert len(set(re.findall(r"\b[0-9a-f]{40}\b", readme))) == 2  # the two upstream commits, in full


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30).stdout
    paths = [ROOT / p for p in out.decode().split("\0") if p]
    return [p for p in paths if p.suffix in (".py", ".md", ".sh", ".yaml", ".toml", ".cfg", ".txt", "")
            and p.is_file() and "third_party" not in p.parts]


@pytest.mark.processes
def test_nothing_points_outside_the_repository():
    """The first design notes and reference data lived in a folder beside the repository; a clone alone must be
    whole, so no file names that folder."""
    outside = re.compile(r"\.\./shared\b|parents\[3\] / \"shared\"|\.parent / \"shared\"")
    offenders = [str(p.relative_to(ROOT)) for p in _tracked_text_files()
                 if outside.search(p.read_text(errors="replace"))]
    assert offenders == []


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", markdown, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def test_every_relative_link_in_the_docs_resolves_inside_the_repository():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), THIRD_PARTY / "README.md",
            CONFORMANCE / "README.md"]
    broken = []
    for doc in docs:
        text = doc.read_text()
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):  # http(s):, mailto: — the web, not the repository
                continue
            path, _, anchor = target.partition("#")
            resolved = (doc.parent / path).resolve() if path else doc
            if not resolved.exists() or ROOT.resolve() not in (resolved, *resolved.parents):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved.read_text()):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []
