"""The local stack `kvgate up` runs on one machine (engines, EPP, Envoy), also started by the chaos bench."""
