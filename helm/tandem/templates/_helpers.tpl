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
{{- /* Every other engine key is the `tandem serve` flag of the same name in
kebab-case (maxNumSeqs: --max-num-seqs). The knobs and their defaults are
declared once, in engine/config.py; values.schema.json lists the keys the
chart takes, and tests/unit/helm/test_knobs.py checks both against the
declaration. A bool is a switch (the flag alone when true); numbers are
float64 in templates, so whole ones are printed through int64. */}}
{{- $notFlags := list "port" "drainGraceSeconds" "terminationMarginSeconds" "extraArgs" }}
{{- range $key := keys $e | sortAlpha }}
{{- if not (has $key $notFlags) }}
{{- $value := get $e $key }}
{{- $flag := printf "--%s" (kebabcase $key) }}
{{- if kindIs "bool" $value }}
{{- if $value }}
{{- $args = append $args $flag }}
{{- end }}
{{- else if and (kindIs "float64" $value) (eq $value (floor $value)) }}
{{- $args = concat $args (list $flag (toString (int64 $value))) }}
{{- else }}
{{- $args = concat $args (list $flag (toString $value)) }}
{{- end }}
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

{{/* ---- gateway: gateway.kind picks the client entry point ---------------- */}}

{{/* The component whose pods may call the pools: the tandem router or smg. */}}
{{- define "tandem.gateway.component" -}}
{{- ternary "gateway" "router" (eq .Values.gateway.kind "smg") }}
{{- end }}

{{/* smg with Kubernetes discovery: it watches the pool pods itself. */}}
{{- define "tandem.gateway.discovery" -}}
{{- if and (eq .Values.gateway.kind "smg") .Values.gateway.discovery.enabled }}true{{ end }}
{{- end }}

{{- define "tandem.gateway.serviceAccountName" -}}
{{- if include "tandem.gateway.discovery" . }}
{{- printf "%s-gateway" (include "tandem.fullname" .) }}
{{- else }}
{{- include "tandem.serviceAccountName" . }}
{{- end }}
{{- end }}

{{/* smg runs from Tandem's image (pyproject pins smg) unless gateway.image says otherwise. */}}
{{- define "tandem.gateway.image" -}}
{{- with .Values.gateway.image }}
{{- if .repository }}
{{- printf "%s:%s" .repository (required "gateway.image.tag is required with gateway.image.repository" .tag) }}
{{- else }}
{{- include "tandem.image" $ }}
{{- end }}
{{- end }}
{{- end }}

{{/* A pool's pod labels as smg selector arguments ("key=value"), sorted:
(dict "root" $ "component" "decode"). */}}
{{- define "tandem.gateway.selector" -}}
{{- $labels := include "tandem.componentSelectorLabels" . | fromYaml }}
{{- range $key := keys $labels | sortAlpha }}
- {{ printf "%s=%v" $key (get $labels $key) | quote }}
{{- end }}
{{- end }}

{{/* The gRPC URL of a pool's headless Service (a single smg worker). */}}
{{- define "tandem.gateway.poolUrl" -}}
{{- $engine := include "tandem.pool.engine" . | fromJson }}
{{- printf "grpc://%s:%d" (include "tandem.poolHost" .) (int $engine.port) }}
{{- end }}

{{/* `smg launch` arguments, one YAML list item per argument. */}}
{{- define "tandem.gateway.args" -}}
{{- $g := .Values.gateway }}
{{- $prefillCtx := dict "root" . "pool" "prefill" "component" "prefill" }}
{{- $decodeCtx := dict "root" . "pool" "decode" "component" "decode" }}
{{- $decode := include "tandem.pool.engine" $decodeCtx | fromJson }}
{{- $args := list "launch" "--host" "0.0.0.0" "--port" (int $g.port) "--backend" "vllm" }}
{{- if eq $g.mode "pd" }}
{{- $args = append $args "--pd-disaggregation" }}
{{- end }}
{{- if $g.discovery.enabled }}
{{- /* One worker per ready pod, found by its labels; the namespace keeps the
watch inside the Role's namespace. A prefill pool on another port says so in
its smg.ai/worker-ports annotation. */}}
{{- $args = concat $args (list "--service-discovery" "--service-discovery-namespace" .Release.Namespace "--service-discovery-port" (int $decode.port)) }}
{{- $decodeSelector := include "tandem.gateway.selector" $decodeCtx | fromYamlArray }}
{{- if eq $g.mode "pd" }}
{{- $args = concat $args (list "--prefill-selector") (include "tandem.gateway.selector" $prefillCtx | fromYamlArray) }}
{{- $args = concat $args (list "--decode-selector") $decodeSelector }}
{{- else }}
{{- $args = concat $args (list "--selector") $decodeSelector }}
{{- end }}
{{- else if eq $g.mode "pd" }}
{{- $args = concat $args (list "--prefill" (include "tandem.gateway.poolUrl" $prefillCtx) "--decode" (include "tandem.gateway.poolUrl" $decodeCtx)) }}
{{- else }}
{{- $args = concat $args (list "--worker-urls" (include "tandem.gateway.poolUrl" $decodeCtx)) }}
{{- end }}
{{- if eq $g.mode "pd" }}
{{- $args = concat $args (list "--prefill-policy" $g.policies.prefill "--decode-policy" $g.policies.decode) }}
{{- else }}
{{- $args = concat $args (list "--policy" $g.policies.colocated) }}
{{- end }}
{{- $level := ternary "warn" .Values.logLevel (eq .Values.logLevel "warning") }}
{{- $args = concat $args (list "--health-check-port" (int $g.healthCheckPort) "--prometheus-host" "0.0.0.0" "--prometheus-port" (int $g.prometheusPort) "--log-level" $level "--shutdown-grace-period-secs" (int $g.shutdownGraceSeconds) "--worker-wedge-secs" (int $g.wedgeSeconds) "--worker-stall-secs" (int $g.stallSeconds)) }}
{{- $args = concat $args ($g.extraArgs | default list) }}
{{- range $args }}
- {{ toString . | quote }}
{{- end }}
{{- end }}

{{/* Settings smg cannot honour fail the render, saying why. */}}
{{- define "tandem.gateway.check" -}}
{{- $g := .Values.gateway }}
{{- if or .Values.auth.router.existingSecret .Values.auth.pools.existingSecret .Values.tls.router.existingSecret .Values.tls.pools.existingSecret }}
{{- fail "auth.* and tls.* are not supported with gateway.kind=smg yet: smg takes an API key only as a command-line flag (the chart never puts a key in args) and the chart reaches the pools over plaintext gRPC. Leave auth and tls empty, or use gateway.kind=tandem." }}
{{- end }}
{{- $ports := list (int $g.port) (int $g.healthCheckPort) (int $g.prometheusPort) }}
{{- if ne (len ($ports | uniq)) 3 }}
{{- fail (printf "gateway.port, gateway.healthCheckPort and gateway.prometheusPort must differ (got %d, %d, %d)" (int $g.port) (int $g.healthCheckPort) (int $g.prometheusPort)) }}
{{- end }}
{{- if not $g.discovery.enabled }}
{{- $used := ternary (dict "prefill" $g.policies.prefill "decode" $g.policies.decode) (dict "colocated" $g.policies.colocated) (eq $g.mode "pd") }}
{{- range $key := keys $used | sortAlpha }}
{{- if eq (get $used $key) "power_of_two" }}
{{- fail (printf "gateway.policies.%s=power_of_two needs at least two workers, and without gateway.discovery.enabled each pool is one smg worker (its Service): enable discovery or pick another policy" $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (eq $g.mode "colocated") (or .Values.prefill.autoscaling.enabled (gt (int .Values.prefill.replicas) 0)) }}
{{- fail "gateway.mode=colocated sends whole requests to the decode pool and none to prefill pods: set prefill.replicas=0 and prefill.autoscaling.enabled=false, or use gateway.mode=pd" }}
{{- end }}
{{- end }}
