"""`kvgate bench chaos`: faults injected into a local stack while streaming traffic flows, counted per request."""
