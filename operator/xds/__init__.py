"""The operator's xDS control plane: Gateways' Envoys fetch listeners, routes, clusters and endpoints over ADS.

xds_files.py turns a Gateway's rendered file set into its xDS form (a minimal bootstrap plus resources);
snapshot.py builds versioned snapshots from it, snapshot_cache.py holds them per node; ads_stream.py keeps one
Envoy stream's protocol rules and ads_server.py serves the streams (state of the world, aggregated);
configmap_source.py feeds every operator replica's cache from the ConfigMaps the leader writes; ack_report.py
carries what each Envoy ACKed or NACKed to the Gateway's ConfigMap, envoy_status.py turns it into the Gateway's
Programmed condition (the leader); serve.py starts a replica's xDS side.
"""
