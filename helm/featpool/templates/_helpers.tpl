{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "featpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: release name, plus the chart name unless the release name already holds it. */}}
{{- define "featpool.fullname" -}}
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

{{- define "featpool.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels: stable across upgrades (a Deployment's selector is immutable). */}}
{{- define "featpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "featpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Standard labels on every object. */}}
{{- define "featpool.labels" -}}
helm.sh/chart: {{ include "featpool.chart" . }}
{{ include "featpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: encoder
app.kubernetes.io/part-of: featpool
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "featpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "featpool.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* image: repository is required; a digest wins over the tag. */}}
{{- define "featpool.image" -}}
{{- $repo := required "image.repository is required: set it to the registry path of an image built from the featpool Dockerfile (e.g. --set image.repository=registry.example.com/featpool)" .Values.image.repository -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" $repo .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The socket path in the container; `$(POD_NAME)` is expanded by the kubelet (env POD_NAME). */}}
{{- define "featpool.socketPath" -}}
{{- $v := .Values -}}
{{- if and $v.socket.fileName (eq $v.socket.volume "hostPath") -}}
{{- /* A fixed name in a shared node directory: only where one pod at a time serves a node. */ -}}
{{- $alone := false -}}
{{- if eq $v.kind "Deployment" -}}
{{- $alone = and (not $v.autoscaling.mode) (le (int $v.replicaCount) 1) (eq (dig "type" "" $v.updateStrategy) "Recreate") -}}
{{- else -}}
{{- $alone = has (toString (dig "rollingUpdate" "maxSurge" 0 $v.updateStrategy)) (list "0" "0%") -}}
{{- end -}}
{{- if not $alone -}}
{{- fail (printf "socket.fileName=%s gives every pod on a node the same socket in the shared hostPath directory, so a second pod there (replicaCount>1, autoscaling, the surge pod of a rolling update) fails to start: leave fileName empty (a socket per pod; consumers find theirs through the index), or run one pod per node without overlap (kind=Deployment with replicaCount=1 and updateStrategy.type=Recreate, or a DaemonSet without maxSurge)" $v.socket.fileName) -}}
{{- end -}}
{{- end -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.socket.mountPath) (default "$(POD_NAME).sock" .Values.socket.fileName) -}}
{{- end -}}

{{/* Seconds the startup probe allows before the kubelet restarts a loading container. */}}
{{- define "featpool.startupBudget" -}}
{{- mul .Values.probes.startup.periodSeconds .Values.probes.startup.failureThreshold -}}
{{- end -}}

{{/* progressDeadlineSeconds: at least the startup budget (a rollout would fail while a pod is still allowed to load). */}}
{{- define "featpool.progressDeadline" -}}
{{- $budget := include "featpool.startupBudget" . | int -}}
{{- if kindIs "invalid" .Values.progressDeadlineSeconds -}}
{{- add $budget 300 -}}
{{- else if lt (int .Values.progressDeadlineSeconds) $budget -}}
{{- fail (printf "progressDeadlineSeconds=%d is shorter than the startup probe budget (probes.startup: %d s): a rollout would fail while its pod is still allowed to load the model" (int .Values.progressDeadlineSeconds) $budget) -}}
{{- else -}}
{{- .Values.progressDeadlineSeconds | int -}}
{{- end -}}
{{- end -}}

{{- define "featpool.modelCacheClaim" -}}
{{- default (printf "%s-model-cache" (include "featpool.fullname" .)) .Values.modelCache.existingClaim -}}
{{- end -}}

{{/* Pod Security `restricted` container securityContext for the chart's helper pods. */}}
{{- define "featpool.restrictedContainerSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Name of the ResourceClaim or ResourceClaimTemplate that holds the GPU under DRA. */}}
{{- define "featpool.gpuClaimName" -}}
{{- if and (eq .Values.dra.gpu.source "existingClaim") (not .Values.dra.gpu.claimName) -}}
{{- fail "dra.gpu.claimName is required when dra.gpu.source is existingClaim: name the ResourceClaim the consumer pods share" -}}
{{- end -}}
{{- if and (ne .Values.dra.gpu.source "template") (or (eq .Values.kind "DaemonSet") (gt (int .Values.replicaCount) 1)) -}}
{{- fail (printf "dra.gpu.source=%s shares one ResourceClaim, so one GPU on one node: it needs kind=Deployment and replicaCount<=1 (use dra.gpu.source=template for a GPU per pod)" .Values.dra.gpu.source) -}}
{{- end -}}
{{- default (printf "%s-gpu" (include "featpool.fullname" .)) .Values.dra.gpu.claimName -}}
{{- end -}}

{{- define "featpool.computeDomainName" -}}
{{- default (printf "%s-compute-domain" (include "featpool.fullname" .)) .Values.fabric.computeDomain.name -}}
{{- end -}}

{{- define "featpool.imexChannelTemplateName" -}}
{{- default (printf "%s-imex-channel" (include "featpool.fullname" .)) .Values.fabric.computeDomain.channelTemplateName -}}
{{- end -}}

{{/*
A settings value as the environment variable string the service parses: strings as they are,
everything else as JSON (so 1073741824 does not become 1.073741824e+09, and lists become the
JSON lists pydantic-settings expects).
*/}}
{{- define "featpool.envValue" -}}
{{- if kindIs "string" . -}}
{{- . -}}
{{- else -}}
{{- toJson . -}}
{{- end -}}
{{- end -}}

{{/* FEATPOOL_FABRIC_LISTEN, or nothing; the checks fail the render with the fix. */}}
{{- define "featpool.fabricListen" -}}
{{- with .Values.fabric.listenPort -}}
{{- if not $.Values.fabric.enabled -}}
{{- fail "fabric.listenPort serves consumers on other nodes through FABRIC handles: it needs fabric.enabled=true (an IMEX channel)" -}}
{{- end -}}
{{- if not $.Values.auth.socketToken.existingSecret -}}
{{- fail "fabric.listenPort needs auth.socketToken.existingSecret: the FABRIC handles it hands out map the pool from any node of the domain" -}}
{{- end -}}
{{- printf "0.0.0.0:%d" (int .) -}}
{{- end -}}
{{- end -}}
