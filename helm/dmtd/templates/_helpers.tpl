{{/* Names and labels shared by the templates. */}}

{{- define "dmtd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dmtd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "dmtd.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "dmtd.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "dmtd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "dmtd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dmtd
{{- end -}}

{{- define "dmtd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dmtd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dmtd.operatorName" -}}
{{- printf "%s-operator" (include "dmtd.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dmtd.redisName" -}}
{{- printf "%s-redis" (include "dmtd.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The registry URL handed to the operator (and by it to the serving pods). */}}
{{- define "dmtd.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s.%s.svc:6379/0" (include "dmtd.redisName" .) .Release.Namespace -}}
{{- else -}}
{{- .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{/* The rules the operator needs, nothing more (see docs/operations.md, RBAC). */}}
{{- define "dmtd.operatorRules" -}}
- apiGroups: ["serving.dmtd.dev"]
  resources: ["dmtddeployments"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["serving.dmtd.dev"]
  resources: ["dmtddeployments/status"]
  verbs: ["get", "patch"]
- apiGroups: ["serving.dmtd.dev"]
  resources: ["dmtddeployments/finalizers"]
  verbs: ["update"]
- apiGroups: ["ray.io"]
  resources: ["rayservices"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}
