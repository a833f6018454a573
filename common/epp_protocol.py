"""The Endpoint Picker Protocol's names, in one place (upstream keeps them in pkg/epp/metadata/consts.go).

Every part of kvgate that speaks the protocol — the EPP's ext-proc server, the Envoy configs kvgate renders, the
conformance port, the benchmarks — imports these rather than spelling the strings again.
"""

from __future__ import annotations

# EPP → gateway: the chosen endpoint(s), "ip:port" or a comma list (primary first, then fallbacks), as a request
# header and, with the same value, as dynamic metadata under DESTINATION_NAMESPACE.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
DESTINATION_KEY = DESTINATION_HEADER

# Gateway → EPP (response path): the endpoint that really served the request, in metadata under envoy.lb.
SERVED_KEY = "x-gateway-destination-endpoint-served"

# Gateway → EPP (request path): the endpoints the gateway allows for this request (a subset of the pool).
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"

# Client → EPP: the InferenceObjective whose priority applies (< 0: sheddable).
OBJECTIVE_HEADER = "x-gateway-inference-objective"
# Client → EPP: latency objectives in milliseconds (llm-d's predicted-latency headers; predicted-latency-scorer).
TTFT_OBJECTIVE_HEADER = "x-slo-ttft-ms"
TPOT_OBJECTIVE_HEADER = "x-slo-tpot-ms"
# Client → EPP: the flow a request belongs to for flow control's fairness within a priority band (upstream's name;
# without it the objective is the flow).
FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"

# Conformance-only names: used by plugins that run only in configs that name them.
TEST_ENDPOINT_SELECTION_HEADER = "test-epp-endpoint-selection"  # header-based-testing-filter
SERVED_TEST_HEADER = "x-conformance-test-served-endpoint"  # destination-endpoint-served-verifier
SERVED_MISSING = "fail: missing destination endpoint served metadata"  # what upstream's test EPP reports then

# Pod label (Kubernetes mode) naming the metrics dialect of the model server the pod runs: vllm (also kvgate's
# engine, which exports vLLM's names), sglang or trtllm; a pod without it is read as vllm.
ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"

# Pod annotations (Kubernetes mode) saying where a model server publishes its KV-cache events (vLLM's
# --kv-events-config; used only when the EPP's config has a precise-prefix-cache-scorer): the PUB port, the
# replay (ROUTER) port and the topic, on the pod's IP. They override `kvgate epp --kv-events-port`,
# `--kv-events-replay-port` and `--kv-events-topic` for that pod; a pod with neither publishes no events.
KV_EVENTS_PORT_ANNOTATION = "kvgate.dev/kv-events-port"
KV_EVENTS_REPLAY_PORT_ANNOTATION = "kvgate.dev/kv-events-replay-port"
KV_EVENTS_TOPIC_ANNOTATION = "kvgate.dev/kv-events-topic"
KV_EVENTS_ANNOTATIONS = (KV_EVENTS_PORT_ANNOTATION, KV_EVENTS_REPLAY_PORT_ANNOTATION, KV_EVENTS_TOPIC_ANNOTATION)
