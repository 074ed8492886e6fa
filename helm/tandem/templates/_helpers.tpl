{{/* ---- names and labels ------------------------------------------------ */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name; objects are named <fullname>-<component>. */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "prefill"). */}}
{{- define "tandem.componentSelectorLabels" -}}
{{ include "tandem.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.componentLabels" -}}
{{ include "tandem.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tandem.image" -}}
{{- $tag := .Values.image.tag }}
{{- if not $tag }}
{{- $tag = ternary (printf "%s-cuda" .Chart.AppVersion) .Chart.AppVersion (eq .Values.image.flavor "cuda") }}
{{- end }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* The DNS name of a pool's headless Service: (dict "root" $ "pool" "prefill"). */}}
{{- define "tandem.poolHost" -}}
{{- printf "%s-%s.%s.svc.%s" (include "tandem.fullname" .root) .pool .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{/* ---- Redis ------------------------------------------------------------- */}}

{{/* True ("true") when the chart deploys Redis. */}}
{{- define "tandem.redis.deployed" -}}
{{- if and .Values.redis.enabled (eq .Values.kvTransfer.connector "redis") }}true{{ end }}
{{- end }}

{{- define "tandem.redis.fullname" -}}
{{- printf "%s-redis" (include "tandem.fullname" .) }}
{{- end }}

{{- define "tandem.redis.secretName" -}}
{{- default (include "tandem.redis.fullname" .) .Values.redis.auth.existingSecret }}
{{- end }}

{{/* The Secret (name, key) that REDIS_PASSWORD comes from, as "name/key"; empty: none. */}}
{{- define "tandem.redis.passwordRef" -}}
{{- if include "tandem.redis.deployed" . }}
{{- printf "%s/%s" (include "tandem.redis.secretName" .) .Values.redis.auth.secretKey }}
{{- else if and (not .Values.redis.enabled) .Values.redis.externalPasswordSecret.name }}
{{- printf "%s/%s" .Values.redis.externalPasswordSecret.name .Values.redis.externalPasswordSecret.key }}
{{- end }}
{{- end }}

{{/* The URL the redis connector uses; $(REDIS_PASSWORD) is expanded by Kubernetes. */}}
{{- define "tandem.redis.url" -}}
{{- if include "tandem.redis.deployed" . }}
{{- printf "redis://:$(REDIS_PASSWORD)@%s.%s.svc.%s:%d/%d" (include "tandem.redis.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.redis.port) (int .Values.redis.db) }}
{{- else }}
{{- $url := required "redis.externalUrl is required when redis.enabled is false and kvTransfer.connector is redis" .Values.redis.externalUrl }}
{{- $secret := .Values.redis.externalPasswordSecret }}
{{- if and (contains "$(REDIS_PASSWORD)" $url) (not $secret.name) }}
{{- fail "redis.externalUrl uses $(REDIS_PASSWORD): set redis.externalPasswordSecret.name and .key (the Secret holding it)" }}
{{- end }}
{{- if and $secret.name (not $secret.key) }}
{{- fail "redis.externalPasswordSecret.key is required with redis.externalPasswordSecret.name" }}
{{- end }}
{{- $url }}
{{- end }}
{{- end }}

{{/* ---- the pools -------------------------------------------------------- */}}

{{/* A pool's engine settings: `engine` overridden by <pool>.engine. (dict "root" $ "pool" "prefill") */}}
{{- define "tandem.pool.engine" -}}
{{- $pool := index .root.Values .pool }}
{{- toJson (mergeOverwrite (deepCopy .root.Values.engine) (deepCopy $pool.engine)) }}
{{- end }}

{{- define "tandem.pool.kvRole" -}}
{{- ternary "kv_producer" "kv_consumer" (eq .pool "prefill") }}
{{- end }}

{{/* --kv-transfer-config of a pool, as JSON. */}}
{{- define "tandem.pool.kvTransferConfig" -}}
{{- $kv := .root.Values.kvTransfer }}
{{- $extra := dict }}
{{- if eq $kv.connector "redis" }}
{{- $_ := set $extra "url" (include "tandem.redis.url" .root) }}
{{- $_ := set $extra "key_prefix" $kv.redis.keyPrefix }}
{{- $_ := set $extra "socket_timeout" $kv.redis.socketTimeoutSeconds }}
{{- if $kv.redis.ttlSeconds }}
{{- $_ := set $extra "ttl_seconds" $kv.redis.ttlSeconds }}
{{- end }}
{{- else if eq $kv.connector "shm" }}
{{- $_ := set $extra "pool_name" $kv.shm.poolName }}
{{- $_ := set $extra "capacity_bytes" (int64 $kv.shm.capacityBytes) }}
{{- else if eq $kv.connector "nixl" }}
{{- /* Where decode pods reach this pod's side channel: its gRPC server at the pod IP. */}}
{{- $_ := set $extra "side_channel_host" "$(POD_IP)" }}
{{- end }}
{{- $extra = mergeOverwrite $extra (deepCopy $kv.extraConfig) }}
{{- toJson (dict "kv_connector" $kv.connector "kv_role" (include "tandem.pool.kvRole" .) "kv_connector_extra_config" $extra) }}
{{- end }}

{{/* The arguments of `tandem` in a pool's server container, one per line as YAML list items. */}}
{{- define "tandem.pool.args" -}}
{{- $root := .root }}
{{- $e := include "tandem.pool.engine" . | fromJson }}
{{- $pool := index $root.Values .pool }}
{{- $args := list "--log-level" $root.Values.logLevel "serve" "--role" .pool "--host" "0.0.0.0" "--port" (toString (int $e.port)) "--metrics-host" "0.0.0.0" "--metrics-port" (toString (int $root.Values.metrics.port)) "--drain-grace" (toString $e.drainGraceSeconds) }}
{{- with $root.Values.tls.pools }}
{{- if .existingSecret }}
{{- /* The Secret is mounted at /etc/tandem/tls (pools-deployment.yaml). */}}
{{- $args = concat $args (list "--tls-cert" "/etc/tandem/tls/tls.crt" "--tls-key" "/etc/tandem/tls/tls.key") }}
{{- if .clientAuth }}
{{- $args = concat $args (list "--tls-client-ca" "/etc/tandem/tls/ca.crt") }}
{{- end }}
{{- end }}
{{- end }}
{{- if ne $root.Values.model.source "package" }}
{{- $args = concat $args (list "--model" (trimSuffix "/" (printf "/models/%s" $root.Values.model.path))) }}
{{- end }}
{{- /* Values are float64 in templates: integers are printed through int64. */}}
{{- $intFlags := dict "maxModelLen" "--max-model-len" "blockSize" "--block-size" "maxNumSeqs" "--max-num-seqs" "maxNumBatchedTokens" "--max-num-batched-tokens" "maxWaitingRequests" "--max-waiting-requests" }}
{{- $flags := dict "dtype" "--dtype" "device" "--device" "kvCacheMemory" "--kv-cache-memory" "gpuMemoryUtilization" "--gpu-memory-utilization" "attentionBackend" "--attention-backend" "kvEventsEndpoint" "--kv-events-endpoint" "kvEventsReplayEndpoint" "--kv-events-replay-endpoint" "kvEventsTopic" "--kv-events-topic" }}
{{- range $key := keys $intFlags | sortAlpha }}
{{- if hasKey $e $key }}
{{- $args = concat $args (list (get $intFlags $key) (toString (int64 (get $e $key)))) }}
{{- end }}
{{- end }}
{{- range $key := keys $flags | sortAlpha }}
{{- if hasKey $e $key }}
{{- $args = concat $args (list (get $flags $key) (toString (get $e $key))) }}
{{- end }}
{{- end }}
{{- $args = concat $args (list "--kv-transfer-config" (include "tandem.pool.kvTransferConfig" .)) }}
{{- with $root.Values.kvTransfer.loadFailurePolicy }}
{{- $args = concat $args (list "--kv-load-failure-policy" .) }}
{{- end }}
{{- with $root.Values.kvTransfer.leaseSeconds }}
{{- $args = concat $args (list "--kv-lease-seconds" (toString .)) }}
{{- end }}
{{- with $root.Values.kvTransfer.transferTimeoutSeconds }}
{{- $args = concat $args (list "--kv-transfer-timeout" (toString .)) }}
{{- end }}
{{- $args = concat $args ($root.Values.engine.extraArgs | default list) ($pool.engine.extraArgs | default list) }}
{{- range $args }}
- {{ toString . | quote }}
{{- end }}
{{- end }}

{{/* terminationGracePeriodSeconds of a pool: longer than its --drain-grace. */}}
{{- define "tandem.pool.terminationGracePeriodSeconds" -}}
{{- $e := include "tandem.pool.engine" . | fromJson }}
{{- add (int (ceil $e.drainGraceSeconds)) (int $e.terminationMarginSeconds) }}
{{- end }}

{{/* ---- API keys and TLS -------------------------------------------------- */}}

{{/* The name the router checks the pools' certificate for. */}}
{{- define "tandem.tls.poolsServerName" -}}
{{- default (printf "%s-pools" (include "tandem.fullname" .)) .Values.tls.pools.serverName }}
{{- end }}

{{/* A probe of a gRPC port: grpc.health.v1 for tandem.v1.Generation, or, with
TLS on the port (the kubelet's gRPC probe speaks plaintext), that it listens.
(dict "port" 50051 "tls" <TLS Secret name or "">) */}}
{{- define "tandem.probe" -}}
{{- if .tls }}
tcpSocket:
  port: {{ .port }}
{{- else }}
grpc:
  port: {{ .port }}
  service: tandem.v1.Generation
{{- end }}
{{- end }}

{{/* An env entry from a Secret's key: (dict "name" "TANDEM_API_KEY" "secret" (dict "existingSecret" .. "key" ..)) */}}
{{- define "tandem.secretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .secret.existingSecret }}
      key: {{ .secret.key }}
{{- end }}

{{/* Settings the chart cannot honour fail the render, saying why. */}}
{{- define "tandem.security.check" -}}
{{- if and (eq .Values.kvTransfer.connector "nixl") (or .Values.auth.pools.existingSecret .Values.tls.pools.existingSecret) }}
{{- fail "auth.pools and tls.pools are not supported with kvTransfer.connector=nixl: the NIXL handshake between pods (their gRPC side channel) sends no API key and speaks no TLS yet. The NetworkPolicy keeps the pools' port to the router and the pools." }}
{{- end }}
{{- end }}
