"""The operator's xDS control plane: Gateways' Envoys fetch listeners, routes, clusters and endpoints over ADS.

xds_files.py turns a Gateway's rendered file set into its xDS form (a minimal bootstrap plus resources);
snapshot.py builds versioned snapshots from it; ads_server.py serves them (state of the world, aggregated);
configmap_source.py feeds every operator replica's server from the ConfigMaps the leader writes;
ack_report.py carries what each Envoy ACKed or NACKed to the Gateway, and back into its Programmed condition.
"""
