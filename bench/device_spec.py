"""The memory bandwidth a GPU's maker specifies, by device name: the bench's decode-step bound is given against it
(the headline) beside the copy bandwidth measured in the same run, which is always lower than the spec.

Only devices listed here have a spec bound; any other (a CPU, a GPU not in the table) has none, and the bench says
so rather than guess."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecBandwidth:
    name: str  # the table's name for the device
    bytes_per_s: float


# (words the device name must all contain, words it must not contain, the entry). The first match wins: the H100's
# PCIe card is named "NVIDIA H100 PCIe", the SXM module "NVIDIA H100 80GB HBM3"; the NVL card is not listed.
_TABLE: tuple[tuple[tuple[str, ...], tuple[str, ...], SpecBandwidth], ...] = (
    (("H200",), (), SpecBandwidth("H200", 4.8e12)),
    (("H100", "PCIE"), (), SpecBandwidth("H100 PCIe", 2.0e12)),
    (("H100", "SXM"), (), SpecBandwidth("H100 SXM", 3.35e12)),
    (("H100", "HBM3"), ("NVL",), SpecBandwidth("H100 SXM", 3.35e12)),
    (("A100", "80GB"), (), SpecBandwidth("A100 80GB", 2.0e12)),
)


def spec_bandwidth(device_name: str | None) -> SpecBandwidth | None:
    """The table's entry for a device name as torch.cuda.get_device_name gives it; None when not listed."""
    if not device_name:
        return None
    name = device_name.upper()
    for needed, excluded, entry in _TABLE:
        if all(w in name for w in needed) and not any(w in name for w in excluded):
            return entry
    return None
