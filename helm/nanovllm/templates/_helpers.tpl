{{/*
Names. The full name is cut to 40 characters so that the longest derived name,
"<fullname>-worker-headless", and the worker pods' host names stay valid DNS labels (63).
*/}}
{{- define "nanovllm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "nanovllm.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "nanovllm.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "nanovllm.router.fullname" -}}
{{- printf "%s-router" (include "nanovllm.fullname" .) }}
{{- end }}

{{- define "nanovllm.worker.fullname" -}}
{{- printf "%s-worker" (include "nanovllm.fullname" .) }}
{{- end }}

{{- define "nanovllm.worker.headlessServiceName" -}}
{{- printf "%s-worker-headless" (include "nanovllm.fullname" .) }}
{{- end }}

{{- define "nanovllm.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "nanovllm.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Labels. Call the component ones with (dict "root" $ "component" "router").
*/}}
{{- define "nanovllm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nanovllm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "nanovllm.labels" -}}
helm.sh/chart: {{ include "nanovllm.chart" . }}
{{ include "nanovllm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "nanovllm.componentSelectorLabels" -}}
{{ include "nanovllm.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "nanovllm.componentLabels" -}}
{{ include "nanovllm.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Images. The router always runs the CPU image; workers run the CUDA one when worker.gpu.enabled.
*/}}
{{- define "nanovllm.router.image" -}}
{{- printf "%s:%s%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) .Values.image.routerTagSuffix }}
{{- end }}

{{- define "nanovllm.worker.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.worker.gpu.enabled }}
{{- $tag = printf "%s%s" $tag .Values.image.cudaTagSuffix }}
{{- end }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/*
The router's worker target: the headless Service's DNS name, which has one A record per worker pod (ready
or not: the router waits for each worker's health). The router looks it up again every few seconds, so
scaling the StatefulSet needs no router change. The mTLS certificate of the workers holds this name.
*/}}
{{- define "nanovllm.workerAddresses" -}}
{{- $headless := include "nanovllm.worker.headlessServiceName" . }}
{{- printf "%s.%s.svc.%s:%d" $headless .Release.Namespace .Values.clusterDomain (int .Values.worker.port) }}
{{- end }}

{{/*
ConfigMap data: the chart's own settings (.managed) plus the user's (.extra), which may set neither those
nor the .reserved ones. Call with (dict "managed" $dict "reserved" (list ...) "extra" .Values.x.config
"path" "x.config").
*/}}
{{- define "nanovllm.configData" -}}
{{- $data := dict }}
{{- range $key, $value := .extra }}
{{- if or (hasKey $.managed $key) (has $key (default (list) $.reserved)) }}
{{- fail (printf "%s.%s is set by the chart from other values; set those instead" $.path $key) }}
{{- end }}
{{- $_ := set $data $key (toString $value) }}
{{- end }}
{{- range $key, $value := .managed }}
{{- $_ := set $data $key (toString $value) }}
{{- end }}
{{- range $key := keys $data | sortAlpha }}
{{ $key }}: {{ get $data $key | quote }}
{{- end }}
{{- end }}

{{/*
The worker's resources: worker.resources, or the preset of the mode; with a GPU, its limit is always the
tensor-parallel size. Call with (dict "root" $ "withGpu" true); without the GPU for init containers, which need
none (the device plugin would otherwise hand them GPUs too).
*/}}
{{- define "nanovllm.worker.resources" -}}
{{- $w := .root.Values.worker }}
{{- $resources := deepCopy (ternary $w.resourcePresets.gpu $w.resourcePresets.cpu $w.gpu.enabled) }}
{{- if $w.resources }}
{{- $resources = deepCopy $w.resources }}
{{- end }}
{{- $limits := default (dict) $resources.limits }}
{{- $requests := default (dict) $resources.requests }}
{{- $_ := unset $limits $w.gpu.resourceName }}
{{- $_ := unset $requests $w.gpu.resourceName }}
{{- if and $w.gpu.enabled .withGpu }}
{{- $_ := set $limits $w.gpu.resourceName (int $w.tensorParallelSize) }}
{{- end }}
{{- if $limits }}{{ $_ := set $resources "limits" $limits }}{{ else }}{{ $_ := unset $resources "limits" }}{{ end }}
{{- if $requests }}{{ $_ := set $resources "requests" $requests }}{{ else }}{{ $_ := unset $resources "requests" }}{{ end }}
{{- toYaml $resources }}
{{- end }}

{{/*
Security contexts: non-root uid/gid 10001 (the image's user), no privilege escalation, no capabilities,
RuntimeDefault seccomp, read-only root filesystem (writable emptyDirs at /tmp and $HOME/.cache).
*/}}
{{- define "nanovllm.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "nanovllm.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
Native gRPC probes (grpc.health.v1, service ""). Call with (dict "port" 50051 "probe" .Values.x.probes.startup).
*/}}
{{- define "nanovllm.grpcProbe" -}}
grpc:
  port: {{ .port }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
{{ toYaml .probe }}
{{- end }}

{{/*
A preStop sleep, so that endpoints and routers drop the pod before it gets SIGTERM, and the grace period that
covers the sleep, the drain and a margin. Call with the component's values.
*/}}
{{- define "nanovllm.preStop" -}}
preStop:
  exec:
    command: ["sleep", "{{ int .preStopSleepSeconds }}"]
{{- end }}

{{- define "nanovllm.terminationGracePeriodSeconds" -}}
{{- add .preStopSleepSeconds .drainTimeoutSeconds .graceMarginSeconds }}
{{- end }}

{{/* HOME of the image's user, whose .cache is a writable emptyDir. */}}
{{- define "nanovllm.cacheDir" -}}
/home/nanovllm/.cache
{{- end }}

{{/* An emptyDir source as inline JSON ({} when neither is set). Call with (dict "sizeLimit" "1Gi" "medium" "Memory"). */}}
{{- define "nanovllm.emptyDir" -}}
{{- $source := dict }}
{{- with .medium }}{{ $_ := set $source "medium" . }}{{ end }}
{{- with .sizeLimit }}{{ $_ := set $source "sizeLimit" . }}{{ end }}
{{- toJson $source }}
{{- end }}

{{/*
TLS and auth. Secrets are mounted as whole volumes (never subPath), so the kubelet's renewal swaps reach the
processes, which read the files again at the next handshake.
*/}}
{{- define "nanovllm.tlsDir" -}}/etc/nanovllm/tls{{- end }}
{{- define "nanovllm.authDir" -}}/etc/nanovllm/auth{{- end }}
{{- define "nanovllm.adminDir" -}}/etc/nanovllm/admin{{- end }}

{{/* The Secret of the router-worker mutual TLS: given, issued by cert-manager, or generated by the chart. */}}
{{- define "nanovllm.internalTlsSecret" -}}
{{- default (printf "%s-internal-tls" (include "nanovllm.fullname" .)) .Values.tls.internal.existingSecret }}
{{- end }}

{{/* Whether the chart itself makes the internal Secret (a generated CA): neither given nor cert-manager's. */}}
{{- define "nanovllm.internalTlsGenerated" -}}
{{- if and .Values.tls.internal.enabled (not .Values.tls.internal.existingSecret) (not .Values.tls.certManager.enabled) }}true{{ end }}
{{- end }}

{{- define "nanovllm.publicTlsSecret" -}}
{{- $p := .Values.tls.public }}
{{- if $p.existingSecret }}{{ $p.existingSecret }}
{{- else if .Values.tls.certManager.enabled }}{{ include "nanovllm.router.fullname" . }}-tls
{{- else }}{{ fail "tls.public.enabled needs tls.public.existingSecret (a Secret with tls.crt and tls.key) or tls.certManager.enabled" }}
{{- end }}
{{- end }}

{{/* The workers' DNS names, for the internal certificate: the headless Service's name, which the router
looks up and checks the certificate against, and every pod under it. */}}
{{- define "nanovllm.workerDnsNames" -}}
{{- $svc := include "nanovllm.worker.headlessServiceName" . }}
{{- list (printf "%s.%s.svc.%s" $svc .Release.Namespace .Values.clusterDomain) (printf "*.%s.%s.svc.%s" $svc .Release.Namespace .Values.clusterDomain) (printf "*.%s.%s.svc" $svc .Release.Namespace) (printf "*.%s" $svc) | toJson }}
{{- end }}

{{/* The router Service's names, for the public certificate. */}}
{{- define "nanovllm.routerDnsNames" -}}
{{- $svc := include "nanovllm.router.fullname" . }}
{{- concat (list $svc (printf "%s.%s" $svc .Release.Namespace) (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.%s" $svc .Release.Namespace .Values.clusterDomain)) .Values.tls.public.dnsNames | toJson }}
{{- end }}

{{/* The port the probes use: the plaintext health port when the gRPC port speaks TLS. Call with (dict "tls" bool "values" .Values.x). */}}
{{- define "nanovllm.probePort" -}}
{{- if .tls }}{{ .values.healthPort }}{{ else }}{{ .values.port }}{{ end }}
{{- end }}

{{/* A Secret volume, read-only for the pod's group only. Call with (dict "name" "internal-tls" "secret" "x"). */}}
{{- define "nanovllm.secretVolume" -}}
- name: {{ .name }}
  secret:
    secretName: {{ .secret }}
    defaultMode: 0440
{{- end }}
