{{/* The chart name, shortened to 63 characters. */}}
{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name, used for the operator's objects. */}}
{{- define "kvgate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Standard labels. */}}
{{- define "kvgate.labels" -}}
helm.sh/chart: {{ include "kvgate.chart" . }}
{{ include "kvgate.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvgate
{{- end }}

{{/* Selector labels of the operator's pods. */}}
{{- define "kvgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvgate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The kvgate image; the tag defaults to the chart's appVersion. */}}
{{- define "kvgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The namespaces the operator serves, as a JSON list: [""] for all namespaces (allNamespaces), watchNamespaces,
or by default the release namespace alone.
*/}}
{{- define "kvgate.watchedNamespaces" -}}
{{- if .Values.allNamespaces }}
{{- if .Values.watchNamespaces }}
{{- fail "allNamespaces and watchNamespaces exclude each other: set one" }}
{{- end }}
{{- list "" | toJson }}
{{- else }}
{{- .Values.watchNamespaces | default (list .Release.Namespace) | toJson }}
{{- end }}
{{- end }}

{{- define "kvgate.envoyImage" -}}
{{- printf "%s:%s" .Values.envoyImage.repository .Values.envoyImage.tag }}
{{- end }}

{{/*
The operator's permissions in the namespaces it watches: exactly the API calls of operator/handlers.py and
operator/apply.py (server-side apply is authorized as get + patch, and as create when the object is new),
plus kopf's watches and Events. Pods, inferencepools, inferenceobjectives and inferencemodelrewrites
get/list/watch are also what the EPP Role it creates grants (operator/pool.py EPP_RBAC_RULES): Kubernetes
only lets it create that Role if it holds those permissions itself (RBAC escalation prevention).
ConfigMaps: list/watch for the watch of ConfigMaps labelled kvgate.dev/epp-config (a pool's EndpointPickerConfig;
get already reads any ConfigMap, so they show it nothing new). NetworkPolicies (networkPolicy.enabled): the
EPPs' policies, watched to put back one a user changed, deleted for a pool that opts out. Events: kopf's and the
autoscaler's scaling decisions on ModelServers; pods list also finds the EPP pods whose metrics it reads.
*/}}
{{- define "kvgate.namespacedRules" -}}
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch"]
{{- if .Values.networkPolicy.enabled }}
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
{{- end }}
{{- if .Values.eppHighAvailability.enabled }}
# The EPPs' leader election (their Role grants these on their Lease; RBAC lets the operator grant only what it
# holds), their PodDisruptionBudgets, and the peer-sync keys of active-active pools.
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "create", "update"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch", "delete"]
# Active-active pools' peer-sync key: created once per pool, never read (operator/epp_peer_sync.py).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
{{- end }}
{{- if .Values.autoscaling.keda.enabled }}
# ModelServers with autoscaling.provider keda: their ScaledObjects (listed to delete those no longer wanted).
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "list", "create", "patch", "delete"]
{{- end }}
- apiGroups: ["kvgate.dev"]
  resources: ["modelservers"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["kvgate.dev"]
  resources: ["modelservers/status"]
  verbs: ["patch"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools/status"]
  verbs: ["patch"]
- apiGroups: ["inference.networking.x-k8s.io"]
  resources: ["inferenceobjectives", "inferencemodelrewrites"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["gateways", "httproutes", "referencegrants"]
  verbs: ["list", "watch"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["gateways/status", "httproutes/status"]
  verbs: ["patch"]
{{- end }}

{{/*
What is cluster-scoped: GatewayClasses (listed, watched, status patched), namespaces (the operator lists them
for allowedRoutes selectors; kopf lists and watches them in namespaced mode) and CRDs (kopf watches them to
notice resources installed after it started).
*/}}
{{- define "kvgate.clusterRules" -}}
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["gatewayclasses"]
  verbs: ["list", "watch"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["gatewayclasses/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end }}

{{/*
The name of the xDS Service (and NetworkPolicy) of the operator Deployment serving namespace "ns" (one per
watched namespace with watchNamespaces), given (dict "root" $ "ns" $ns): the Deployment's name and "-xds".
*/}}
{{- define "kvgate.xdsName" -}}
{{- $name := include "kvgate.fullname" .root }}
{{- if .root.Values.watchNamespaces }}
{{- $name = printf "%s-%s" (include "kvgate.fullname" .root | trunc 40 | trimSuffix "-") .ns | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- printf "%s-xds" ($name | trunc 59 | trimSuffix "-") }}
{{- end }}
