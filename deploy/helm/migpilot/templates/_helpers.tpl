{{- define "migpilot.name" -}}migpilot{{- end -}}

{{- define "migpilot.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "migpilot.labels" -}}
app.kubernetes.io/name: migpilot
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "migpilot.selector" -}}
app.kubernetes.io/name: migpilot
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The webhook's Service name (the serving certificate is issued for it). */}}
{{- define "migpilot.webhookService" -}}{{ .Release.Name }}-webhook{{- end -}}

{{/* CEL: the pod asks (requests or limits) for some nvidia.com/mig- resource; equal to
     migpilot.webhook.registering.MIG_CONDITION (a test checks). */}}
{{- define "migpilot.migCondition" -}}
object.spec.containers.exists(c, has(c.resources) && ((has(c.resources.requests) && c.resources.requests.exists(r, r.startsWith('nvidia.com/mig-'))) || (has(c.resources.limits) && c.resources.limits.exists(r, r.startsWith('nvidia.com/mig-'))))) || (has(object.spec.initContainers) && object.spec.initContainers.exists(c, has(c.resources) && ((has(c.resources.requests) && c.resources.requests.exists(r, r.startsWith('nvidia.com/mig-'))) || (has(c.resources.limits) && c.resources.limits.exists(r, r.startsWith('nvidia.com/mig-'))))))
{{- end -}}

{{/* agent.migPartedConfigMap (NAMESPACE/NAME[:KEY]) as {namespace, name}, as the agent's
     statics.ConfigMapRef.parse reads it. */}}
{{- define "migpilot.migPartedConfigMap" -}}
{{- $ref := .Values.agent.migPartedConfigMap | splitList ":" | first }}
{{- $parts := splitList "/" $ref }}
namespace: {{ first $parts | quote }}
name: {{ last $parts | quote }}
{{- end -}}
