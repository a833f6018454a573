"""How long the suite waits. Upstream's defaults are minutes (cloud load balancers); ours are seconds where a
controller on a healthy cluster settles in seconds, and every one can be scaled with --timeout-scale."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class Timing:
    gateway_address_s: float = 180.0        # a Gateway gets status.addresses
    pods_ready_s: float = 300.0             # base backends and EPPs Ready
    condition_s: float = 120.0              # a status condition appears / changes
    traffic_s: float = 120.0                # a request eventually gets the expected answer
    delete_s: float = 120.0                 # a test's objects are gone
    route_deletion_settle_s: float = 5.0    # upstream sleeps this long after deleting a route before checking
    request_timeout_s: float = 10.0
    consecutive_successes: int = 3          # upstream's RequiredConsecutiveSuccesses

    def scaled(self, factor: float) -> "Timing":
        out = Timing(**{f.name: getattr(self, f.name) for f in fields(self)})
        for f in fields(self):
            if f.name.endswith("_s"):
                setattr(out, f.name, getattr(self, f.name) * factor)
        return out
