"""A Python port of the Gateway API Inference Extension conformance suite (`kvgate conformance`).

It applies the upstream suite's manifests (manifests/, unchanged but for the gateway class, and our EPP in
place of upstream's test EPP when --epp-image is given) to any cluster reachable through a kubeconfig,
runs the ported tests against the Gateway implementation of the given GatewayClass, and writes a
ConformanceReport YAML. See suite.py (runner and report), cases.py (the tests), checks.py and traffic.py.
"""
