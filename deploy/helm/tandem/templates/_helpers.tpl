{{/* Names, labels and the pieces every Tandem pod shares. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The name of one component's objects: <fullname>-<component>. */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* A Service's cluster DNS name: <name>.<namespace>.svc.<clusterDomain>. */}}
{{- define "tandem.serviceHost" -}}
{{- printf "%s.%s.svc.%s" (include "tandem.componentName" .) .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end -}}

{{/* image: the global image, or `override` (a map with repository/tag) when it names a
repository. */}}
{{- define "tandem.image" -}}
{{- $image := .root.Values.image -}}
{{- $override := .override | default dict -}}
{{- $repository := $override.repository | default $image.repository -}}
{{- $tag := $override.tag | default $image.tag | default .root.Chart.AppVersion -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}

{{/* The worker sets this release runs, in order: "both", or "prefill decode". */}}
{{- define "tandem.workerSets" -}}
{{- if .Values.workers.both.enabled -}}
both
{{- else -}}
{{- if or (lt (int .Values.workers.prefill.replicas) 1) (lt (int .Values.workers.decode.replicas) 1) -}}
{{- fail "workers.prefill.replicas and workers.decode.replicas must be >= 1 (or set workers.both.enabled)" -}}
{{- end -}}
prefill decode
{{- end -}}
{{- end -}}

{{/* The scheduler's --workers: host:port of every worker pod of every set, by its stable
StatefulSet DNS name <set>-<i>.<set>.<namespace>.svc.<clusterDomain>. */}}
{{- define "tandem.workerAddresses" -}}
{{- $root := . -}}
{{- $addresses := list -}}
{{- range $set := splitList " " (include "tandem.workerSets" $root) -}}
{{- $name := include "tandem.componentName" (dict "root" $root "component" $set) -}}
{{- $host := include "tandem.serviceHost" (dict "root" $root "component" $set) -}}
{{- $replicas := int (index $root.Values.workers $set).replicas -}}
{{- if lt $replicas 1 -}}
{{- fail (printf "workers.%s.replicas must be >= 1" $set) -}}
{{- end -}}
{{- range $i := until $replicas -}}
{{- $addresses = append $addresses (printf "%s-%d.%s:%d" $name $i $host (int $root.Values.workers.port)) -}}
{{- end -}}
{{- end -}}
{{- join "," $addresses -}}
{{- end -}}

{{/* terminationGracePeriodSeconds for a drain timeout: the timeout plus the margin. */}}
{{- define "tandem.gracePeriod" -}}
{{- add (ceil .drain | int) (int .root.Values.drainMarginSeconds) -}}
{{- end -}}

{{/* Environment shared by every Tandem container: TLS exactly as docs/security.md. */}}
{{- define "tandem.tlsEnv" -}}
{{- $tls := .Values.tls -}}
{{- if $tls.enabled }}
- name: TANDEM_TLS_CERT
  value: {{ printf "%s/tls.crt" $tls.mountPath | quote }}
- name: TANDEM_TLS_KEY
  value: {{ printf "%s/tls.key" $tls.mountPath | quote }}
- name: TANDEM_TLS_CA
  value: {{ printf "%s/ca.crt" $tls.mountPath | quote }}
{{- if $tls.clientAuth }}
- name: TANDEM_TLS_CLIENT_AUTH
  value: "1"
{{- end }}
{{- with $tls.serverName }}
- name: TANDEM_TLS_SERVER_NAME
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "tandem.tlsVolume" -}}
{{- if .Values.tls.enabled }}
{{- if not .Values.tls.secretName }}
{{- fail "tls.enabled needs tls.secretName (a Secret with tls.crt, tls.key and ca.crt)" }}
{{- end }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "tandem.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* The model folder passed as --model. */}}
{{- define "tandem.modelPath" -}}
{{- printf "%s/%s" (.Values.model.mountPath | trimSuffix "/") .Values.model.folder -}}
{{- end -}}

{{- define "tandem.modelVolume" -}}
{{- $model := .Values.model -}}
- name: model
{{- if eq $model.source "builtin" }}
  emptyDir: {}
{{- else if eq $model.source "pvc" }}
{{- if not $model.pvc.claimName }}
{{- fail "model.source=pvc needs model.pvc.claimName" }}
{{- end }}
  persistentVolumeClaim:
    claimName: {{ $model.pvc.claimName }}
    readOnly: true
{{- else if eq $model.source "hostPath" }}
{{- if not $model.hostPath.path }}
{{- fail "model.source=hostPath needs model.hostPath.path" }}
{{- end }}
  hostPath:
    path: {{ $model.hostPath.path }}
    type: Directory
{{- else }}
{{- fail (printf "model.source must be builtin, pvc or hostPath, got %q" $model.source) }}
{{- end }}
{{- end -}}

{{- define "tandem.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
{{- if ne .Values.model.source "builtin" }}
  readOnly: true
{{- end }}
{{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
{{- end }}
{{- end -}}

{{/* builtin model: an init container that writes the embedded test model. */}}
{{- define "tandem.modelInit" -}}
{{- if eq .Values.model.source "builtin" }}
initContainers:
  - name: build-model
    image: {{ include "tandem.image" (dict "root" .) }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["python", "-m", "devtools.checkpoint_builder", "--out", {{ include "tandem.modelPath" . | quote }}]
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    volumeMounts:
      {{- include "tandem.modelMount" . | nindent 6 }}
    {{- with .Values.model.builtin.resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
{{- end }}
{{- end -}}

{{/* A health probe on `port`: Kubernetes' grpc probe, or under TLS an exec probe that
runs common.healthcheck in the container with its TLS environment ("http": the HTTP
front's GET /health; "tcp": the port is open). `timing` holds periodSeconds etc. */}}
{{- define "tandem.probe" -}}
{{- $tls := .root.Values.tls.enabled -}}
{{- if eq .kind "tcp" }}
tcpSocket:
  port: {{ .port }}
{{- else if eq .kind "http" }}
{{- if $tls }}
exec:
  command: ["python", "-m", "common.healthcheck", "--http", {{ printf "127.0.0.1:%d" (int .port) | quote }}]
{{- else }}
httpGet:
  path: /health
  port: {{ .port }}
{{- end }}
{{- else if $tls }}
exec:
  command: ["python", "-m", "common.healthcheck", {{ printf "127.0.0.1:%d" (int .port) | quote }}]
{{- else }}
grpc:
  port: {{ .port }}
{{- end }}
{{ toYaml .timing }}
{{- end -}}

{{/* Pod settings every component shares: no Service environment variables (with a
release named "tandem" Kubernetes would inject TANDEM_GATEWAY_PORT=tcp://..., which is a
Tandem setting's name); nodeSelector, tolerations, affinity (the component's own, else the
global ones); pull secrets; the pod security context. */}}
{{- define "tandem.podCommon" -}}
enableServiceLinks: false
{{- with (.component.nodeSelector | default .root.Values.nodeSelector) }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (.component.tolerations | default .root.Values.tolerations) }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (.component.affinity | default .root.Values.affinity) }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Pod annotations: global, then the component's. */}}
{{- define "tandem.podAnnotations" -}}
{{- $annotations := merge (deepCopy (.component.podAnnotations | default dict)) (.root.Values.podAnnotations | default dict) -}}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* --metrics-port for gateway, scheduler and workers when metrics are on. */}}
{{- define "tandem.metricsArgs" -}}
{{- if .Values.metrics.enabled }}
- --metrics-port
- {{ .Values.metrics.port | quote }}
{{- end }}
{{- end -}}

{{- define "tandem.metricsContainerPort" -}}
{{- if .Values.metrics.enabled }}
- name: metrics
  containerPort: {{ .Values.metrics.port }}
{{- end }}
{{- end -}}

{{- define "tandem.metricsServicePort" -}}
{{- if .Values.metrics.enabled }}
- name: metrics
  port: {{ .Values.metrics.port }}
  targetPort: metrics
{{- end }}
{{- end -}}

{{/* A container's env: TLS, then the component's extraEnv; nothing when both are empty. */}}
{{- define "tandem.env" -}}
{{- $entries := include "tandem.tlsEnv" .root | trim -}}
{{- with .component.extraEnv }}
{{- $entries = printf "%s\n%s" $entries (toYaml .) | trim -}}
{{- end }}
{{- with .first }}
{{- $entries = printf "%s\n%s" (. | trim) $entries | trim -}}
{{- end }}
{{- if $entries }}
env:
  {{- $entries | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Seconds a worker may take to start: its startup probe's window. The scheduler waits
that long for the workers and the gateway for the scheduler, so neither gives up (and
restarts) while Kubernetes still lets a worker load its model. */}}
{{- define "tandem.workerStartupSeconds" -}}
{{- mul (int .Values.probes.workerStartup.periodSeconds) (int .Values.probes.workerStartup.failureThreshold) -}}
{{- end -}}
