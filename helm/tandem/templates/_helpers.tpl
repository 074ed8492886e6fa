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
declaration. A bool is a switch (the flag alone when true), except that a
knob with three states (unset, true, false: int8Activations) says false
too; a list is the flag followed by its values; numbers are float64 in
templates, so whole ones are printed through int64. */}}
{{- $notFlags := list "port" "drainGraceSeconds" "terminationMarginSeconds" "extraArgs" }}
{{- $threeState := list "int8Activations" }}
{{- range $key := keys $e | sortAlpha }}
{{- if not (has $key $notFlags) }}
{{- $value := get $e $key }}
{{- $flag := printf "--%s" (kebabcase $key) }}
{{- if kindIs "bool" $value }}
{{- if $value }}
{{- $args = append $args $flag }}
{{- else if has $key $threeState }}
{{- $args = concat $args (list $flag "false") }}
{{- end }}
{{- else if kindIs "slice" $value }}
{{- /* A list (cudaGraphSizes): the flag, then each value. */}}
{{- $args = append $args $flag }}
{{- range $value }}
{{- $args = append $args (toString (int64 .)) }}
{{- end }}
{{- else if and (kindIs "float64" $value) (eq $value (floor $value)) }}
{{- $args = concat $args (list $flag (toString (int64 $value))) }}
{{- else }}
{{- $args = concat $args (list $flag (toString $value)) }}
{{- end }}
{{- end }}
{{- end }}
{{- $args = concat $args (include "tandem.lora.args" $root | fromYamlArray) }}
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

{{/* ---- LoRA adapters ------------------------------------------------------ */}}

{{/* Where the adapter directories are in a pool container: their own volume
at /adapters, or the model's at /models (lora.source=model). */}}
{{- define "tandem.lora.root" -}}
{{- ternary "/models" "/adapters" (eq .Values.lora.source "model") }}
{{- end }}

{{/* True ("true") when some adapter is loaded at start (has a path). */}}
{{- define "tandem.lora.hasModules" -}}
{{- range .Values.lora.adapters }}{{ if .path }}true{{ end }}{{ end }}
{{- end }}

{{/* True ("true") when the pools mount an adapter volume of their own. */}}
{{- define "tandem.lora.volume" -}}
{{- if and (include "tandem.lora.hasModules" .) (ne .Values.lora.source "model") }}true{{ end }}
{{- end }}

{{/* The adapters served on a port of their own (--lora-port NAME=PORT), for
smg, whose engine protocol carries no adapter: each port is one more smg
worker whose model is the adapter. A JSON list, in lora.adapters' order, of
{"name", "port", "portName"}; portName is the container (and pool Service)
port's name, lora-<index in lora.adapters>. */}}
{{- define "tandem.lora.ports" -}}
{{- $out := list }}
{{- range $i, $a := .Values.lora.adapters }}
{{- if $a.port }}
{{- $out = append $out (dict "name" $a.name "port" (int $a.port) "portName" (printf "lora-%d" $i)) }}
{{- end }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* Every pool pod listens on every adapter port besides its own ports, so
they must all differ; the render fails naming the two owners. */}}
{{- define "tandem.lora.check" -}}
{{- $taken := dict }}
{{- range $pool := list "prefill" "decode" }}
{{- $e := include "tandem.pool.engine" (dict "root" $ "pool" $pool) | fromJson }}
{{- $key := toString (int $e.port) }}
{{- $_ := set $taken $key (ternary "the pools' engine port" (printf "%s.engine.port" $pool) (hasKey $taken $key)) }}
{{- end }}
{{- $_ := set $taken (toString (int .Values.metrics.port)) "metrics.port" }}
{{- if eq .Values.gateway.kind "sidecar" }}
{{- $g := .Values.gateway }}
{{- $_ := set $taken (toString (int $g.port)) "gateway.port (the smg sidecar's, in every decode pod)" }}
{{- $_ := set $taken (toString (int $g.healthCheckPort)) "gateway.healthCheckPort (the smg sidecar's, in every decode pod)" }}
{{- $_ := set $taken (toString (int $g.sidecar.prometheusPort)) "gateway.sidecar.prometheusPort (in every decode pod)" }}
{{- end }}
{{- range $a := include "tandem.lora.ports" . | fromJsonArray }}
{{- $key := toString (int $a.port) }}
{{- with get $taken $key }}
{{- fail (printf "lora.adapters: the port %s of adapter %q is also %s: every pool pod listens on each adapter's port beside its own, so they must all differ" $key $a.name .) }}
{{- end }}
{{- $_ := set $taken $key (printf "the port of adapter %q" $a.name) }}
{{- end }}
{{- end }}

{{/* `tandem serve` LoRA flags, the same for both pools (a prefill pod computes
a prompt's KV under its adapter, a decode pod the tokens), as a YAML list:
--enable-lora, --lora-modules NAME=PATH for the adapters loaded at start (a
path), --lora-port NAME=PORT for those with a port. An adapter with a port
and no path is loaded later (`tandem lora load`): that needs lora.enabled. */}}
{{- define "tandem.lora.args" -}}
{{- $lora := .Values.lora }}
{{- $args := list }}
{{- $names := list }}
{{- $modules := list }}
{{- $root := include "tandem.lora.root" . }}
{{- range $lora.adapters }}
{{- if has .name $names }}
{{- fail (printf "lora.adapters: the name %q is given twice (a request names one adapter)" .name) }}
{{- end }}
{{- $names = append $names .name }}
{{- if .path }}
{{- $modules = append $modules (printf "%s=%s/%s" .name $root (trimPrefix "/" .path)) }}
{{- else if not $lora.enabled }}
{{- fail (printf "lora.adapters: %q has a port and no path, so no pod loads it at start (load it later: tandem lora load), and that needs lora.enabled=true" .name) }}
{{- end }}
{{- end }}
{{- if or $lora.enabled $modules }}
{{- $args = append $args "--enable-lora" }}
{{- end }}
{{- if $modules }}
{{- if and (eq $lora.source "model") (eq .Values.model.source "package") }}
{{- fail "lora.source=model reads adapters from the model's volume: use it with model.source pvc or hostPath (the package source's volume holds only the model)" }}
{{- end }}
{{- $args = concat $args (list "--lora-modules") $modules }}
{{- end }}
{{- range include "tandem.lora.ports" . | fromJsonArray }}
{{- $args = concat $args (list "--lora-port" (printf "%s=%d" .name (int .port))) }}
{{- end }}
{{- toYaml $args }}
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

{{/* The component of the client entry point's objects: the tandem router's,
or smg's (its Deployment, or with gateway.kind=sidecar the Service in front
of the sidecars). */}}
{{- define "tandem.gateway.component" -}}
{{- ternary "router" "gateway" (eq .Values.gateway.kind "tandem") }}
{{- end }}

{{/* True ("true") when smg runs as a sidecar in the pods of `pool`:
(dict "root" $ "pool" "decode"). The decode pods only: a request's tokens
stream from them, their KV memory is what a picker weighs, and with
mode=pd their sidecar sends the prefill to the prefill pool. */}}
{{- define "tandem.gateway.sidecarIn" -}}
{{- if and (eq .root.Values.gateway.kind "sidecar") (eq .pool "decode") }}true{{ end }}
{{- end }}

{{/* How long a sidecar's smg retries registering its workers (its pod's
Tandem, with mode=pd the prefill pool) before it gives up. */}}
{{- define "tandem.gateway.sidecarStartupSeconds" -}}
1800
{{- end }}

{{/* smg's metrics port: a sidecar shares its pod's ports with Tandem's. */}}
{{- define "tandem.gateway.prometheusPort" -}}
{{- $g := .Values.gateway }}
{{- int (ternary $g.sidecar.prometheusPort $g.prometheusPort (eq $g.kind "sidecar")) }}
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

{{/* The gRPC URLs of a pool's headless Service as a JSON list: its engine
port (the base model), then each adapter's port (--lora-port: the adapter
as a model of its own), one smg worker each. */}}
{{- define "tandem.gateway.poolUrls" -}}
{{- $host := include "tandem.poolHost" . }}
{{- $urls := list (include "tandem.gateway.poolUrl" .) }}
{{- range include "tandem.lora.ports" .root | fromJsonArray }}
{{- $urls = append $urls (printf "grpc://%s:%d" $host (int .port)) }}
{{- end }}
{{- toJson $urls }}
{{- end }}

{{/* smg's P/D worker flags, one per URL (--prefill U1 --prefill U2), as a
list: (dict "flag" "--prefill" "urls" (list ...)). */}}
{{- define "tandem.gateway.workerArgs" -}}
{{- $args := list }}
{{- range .urls }}
{{- $args = concat $args (list $.flag .) }}
{{- end }}
{{- toJson $args }}
{{- end }}

{{/* `smg launch` arguments, one YAML list item per argument. */}}
{{- define "tandem.gateway.args" -}}
{{- $g := .Values.gateway }}
{{- $prefillCtx := dict "root" . "pool" "prefill" "component" "prefill" }}
{{- $decodeCtx := dict "root" . "pool" "decode" "component" "decode" }}
{{- $decode := include "tandem.pool.engine" $decodeCtx | fromJson }}
{{- $loraPorts := include "tandem.lora.ports" . | fromJsonArray }}
{{- $args := list "launch" "--host" "0.0.0.0" "--port" (int $g.port) "--backend" "vllm" }}
{{- if eq $g.mode "pd" }}
{{- $args = append $args "--pd-disaggregation" }}
{{- end }}
{{- if eq $g.kind "sidecar" }}
{{- /* The pod's own Tandem over loopback (it listens on 0.0.0.0); with
mode=pd the prefill pool through its headless Service, as without discovery
(discovery would need a pod-reading token in every decode pod). Each LoRA
adapter's port is one more worker (per role), whose model is the adapter. */}}
{{- $local := list (printf "grpc://127.0.0.1:%d" (int $decode.port)) }}
{{- range $loraPorts }}
{{- $local = append $local (printf "grpc://127.0.0.1:%d" (int .port)) }}
{{- end }}
{{- if eq $g.mode "pd" }}
{{- $args = concat $args (include "tandem.gateway.workerArgs" (dict "flag" "--prefill" "urls" (include "tandem.gateway.poolUrls" $prefillCtx | fromJsonArray)) | fromJsonArray) }}
{{- $args = concat $args (include "tandem.gateway.workerArgs" (dict "flag" "--decode" "urls" $local) | fromJsonArray) }}
{{- else }}
{{- $args = concat $args (list "--worker-urls") $local }}
{{- end }}
{{- /* smg registers a worker that is not up yet (the model still loading)
by retrying every check interval (smg: 30 s) until the startup timeout, and
then gives up for good, staying unready. Every 5 s: the pod is Ready soon
after its model is; the sidecar's liveness probe restarts smg if it is still
unready after the timeout (tandem.gateway.sidecar). */}}
{{- $args = concat $args (list "--worker-startup-check-interval" 5 "--worker-startup-timeout-secs" (include "tandem.gateway.sidecarStartupSeconds" .)) }}
{{- else if $g.discovery.enabled }}
{{- /* One worker per ready pod, found by its labels; the namespace keeps the
watch inside the Role's namespace. A pod serving more than the decode port
(a prefill pool on another port, LoRA adapters on ports of their own) lists
its ports in its smg.ai/worker-ports annotation: one worker per port. */}}
{{- $args = concat $args (list "--service-discovery" "--service-discovery-namespace" .Release.Namespace "--service-discovery-port" (int $decode.port)) }}
{{- $decodeSelector := include "tandem.gateway.selector" $decodeCtx | fromYamlArray }}
{{- if eq $g.mode "pd" }}
{{- $args = concat $args (list "--prefill-selector") (include "tandem.gateway.selector" $prefillCtx | fromYamlArray) }}
{{- $args = concat $args (list "--decode-selector") $decodeSelector }}
{{- else }}
{{- $args = concat $args (list "--selector") $decodeSelector }}
{{- end }}
{{- else if eq $g.mode "pd" }}
{{- $args = concat $args (include "tandem.gateway.workerArgs" (dict "flag" "--prefill" "urls" (include "tandem.gateway.poolUrls" $prefillCtx | fromJsonArray)) | fromJsonArray) }}
{{- $args = concat $args (include "tandem.gateway.workerArgs" (dict "flag" "--decode" "urls" (include "tandem.gateway.poolUrls" $decodeCtx | fromJsonArray)) | fromJsonArray) }}
{{- else }}
{{- $args = concat $args (list "--worker-urls") (include "tandem.gateway.poolUrls" $decodeCtx | fromJsonArray) }}
{{- end }}
{{- if eq $g.mode "pd" }}
{{- $args = concat $args (list "--prefill-policy" $g.policies.prefill "--decode-policy" $g.policies.decode) }}
{{- else }}
{{- $args = concat $args (list "--policy" $g.policies.colocated) }}
{{- end }}
{{- $level := ternary "warn" .Values.logLevel (eq .Values.logLevel "warning") }}
{{- $args = concat $args (list "--health-check-port" (int $g.healthCheckPort) "--prometheus-host" "0.0.0.0" "--prometheus-port" (include "tandem.gateway.prometheusPort" .) "--log-level" $level "--shutdown-grace-period-secs" (int $g.shutdownGraceSeconds) "--worker-wedge-secs" (int $g.wedgeSeconds) "--worker-stall-secs" (int $g.stallSeconds)) }}
{{- $args = concat $args ($g.extraArgs | default list) }}
{{- range $args }}
- {{ toString . | quote }}
{{- end }}
{{- end }}

{{/* Settings smg cannot honour fail the render, saying why. */}}
{{- define "tandem.gateway.check" -}}
{{- $g := .Values.gateway }}
{{- if or .Values.auth.router.existingSecret .Values.auth.pools.existingSecret .Values.tls.router.existingSecret .Values.tls.pools.existingSecret }}
{{- fail (printf "auth.* and tls.* are not supported with gateway.kind=%s yet: smg takes an API key only as a command-line flag (the chart never puts a key in args) and the chart reaches the pools over plaintext gRPC. Leave auth and tls empty, or use gateway.kind=tandem." $g.kind) }}
{{- end }}
{{- if eq $g.kind "sidecar" }}
{{- /* One network namespace: the sidecar's ports and the decode pod's own. */}}
{{- $decode := include "tandem.pool.engine" (dict "root" . "pool" "decode") | fromJson }}
{{- $ports := list (int $g.port) (int $g.healthCheckPort) (int $g.sidecar.prometheusPort) (int $decode.port) (int .Values.metrics.port) }}
{{- if ne (len ($ports | uniq)) 5 }}
{{- fail (printf "with gateway.kind=sidecar, smg shares the decode pods' ports: gateway.port, gateway.healthCheckPort, gateway.sidecar.prometheusPort, decode's engine port and metrics.port must differ (got %d, %d, %d, %d, %d)" (int $g.port) (int $g.healthCheckPort) (int $g.sidecar.prometheusPort) (int $decode.port) (int .Values.metrics.port)) }}
{{- end }}
{{- else }}
{{- $ports := list (int $g.port) (int $g.healthCheckPort) (int $g.prometheusPort) }}
{{- if ne (len ($ports | uniq)) 3 }}
{{- fail (printf "gateway.port, gateway.healthCheckPort and gateway.prometheusPort must differ (got %d, %d, %d)" (int $g.port) (int $g.healthCheckPort) (int $g.prometheusPort)) }}
{{- end }}
{{- end }}
{{- if eq $g.kind "sidecar" }}
{{- /* A sidecar has one worker per role: its pod, and the prefill Service. */}}
{{- $used := ternary (dict "prefill" $g.policies.prefill "decode" $g.policies.decode) (dict "colocated" $g.policies.colocated) (eq $g.mode "pd") }}
{{- range $key := keys $used | sortAlpha }}
{{- if eq (get $used $key) "power_of_two" }}
{{- fail (printf "gateway.policies.%s=power_of_two needs at least two workers, and a sidecar has one per role (its own pod; with mode=pd, the prefill pool's Service): pick another policy" $key) }}
{{- end }}
{{- end }}
{{- else if not $g.discovery.enabled }}
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

{{/* The smg container of a decode pod with gateway.kind=sidecar: OpenAI HTTP
on the pod's IP for an endpoint picker (an InferencePool's targetPorts) or
the <fullname>-gateway Service. Its named ports differ from Tandem's (one
pod, one namespace of port names). */}}
{{- define "tandem.gateway.sidecar" -}}
{{- $g := .Values.gateway }}
- name: smg
  image: {{ include "tandem.gateway.image" . }}
  imagePullPolicy: {{ $g.image.pullPolicy | default .Values.image.pullPolicy }}
  command: ["smg"]
  args:
    {{- include "tandem.gateway.args" . | trim | nindent 4 }}
  ports:
    - name: http
      containerPort: {{ int $g.port }}
      protocol: TCP
    - name: smg-health
      containerPort: {{ int $g.healthCheckPort }}
      protocol: TCP
    - name: smg-metrics
      containerPort: {{ include "tandem.gateway.prometheusPort" . }}
      protocol: TCP
  # /readiness answers 503 until the pod's own Tandem (and with mode=pd a
  # prefill pod) is healthy, and while smg drains: the pod is Ready, and
  # picked, only when it can serve a request whole.
  readinessProbe:
    httpGet:
      path: /readiness
      port: smg-health
    periodSeconds: 5
    failureThreshold: 2
    timeoutSeconds: 5
  # Unready for longer than smg retries registering its workers: it gave up
  # (say, the prefill pool was down all that time), and only a restart makes
  # it try again. A model still loading within that time restarts nothing.
  livenessProbe:
    httpGet:
      path: /readiness
      port: smg-health
    periodSeconds: 30
    failureThreshold: {{ add (div (include "tandem.gateway.sidecarStartupSeconds" . | int) 30) 2 }}
    timeoutSeconds: 5
  {{- with $g.sidecar.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: home
      mountPath: /home/tandem
{{- end }}
