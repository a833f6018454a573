"""The Endpoint Picker (EPP): an Envoy ext-proc server that picks, per request, the engine pod to serve it."""
