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

{{/* CEL: the pod asks (requests or limits) for some nvidia.com/mig- resource, makes a unified
     request (nvidia.com/gpumem, gpumem-percentage, gpucores, or the nvidia.com/vgpu-mode
     annotation) or names DRA claims (spec.resourceClaims); equal to
     migpilot.webhook.registering.GATE_CONDITION (a test checks). */}}
{{- define "migpilot.gateCondition" -}}
object.spec.containers.exists(c, has(c.resources) && ((has(c.resources.requests) && c.resources.requests.exists(r, r.startsWith('nvidia.com/mig-') || r.startsWith('nvidia.com/gpu-') || r in ['nvidia.com/gpumem', 'nvidia.com/gpumem-percentage', 'nvidia.com/gpucores'] || r == 'nvidia.com/gpu')) || (has(c.resources.limits) && c.resources.limits.exists(r, r.startsWith('nvidia.com/mig-') || r.startsWith('nvidia.com/gpu-') || r in ['nvidia.com/gpumem', 'nvidia.com/gpumem-percentage', 'nvidia.com/gpucores'] || r == 'nvidia.com/gpu')))) || (has(object.spec.initContainers) && object.spec.initContainers.exists(c, has(c.resources) && ((has(c.resources.requests) && c.resources.requests.exists(r, r.startsWith('nvidia.com/mig-') || r.startsWith('nvidia.com/gpu-') || r in ['nvidia.com/gpumem', 'nvidia.com/gpumem-percentage', 'nvidia.com/gpucores'] || r == 'nvidia.com/gpu')) || (has(c.resources.limits) && c.resources.limits.exists(r, r.startsWith('nvidia.com/mig-') || r.startsWith('nvidia.com/gpu-') || r in ['nvidia.com/gpumem', 'nvidia.com/gpumem-percentage', 'nvidia.com/gpucores'] || r == 'nvidia.com/gpu'))))) || (has(object.metadata.annotations) && 'nvidia.com/vgpu-mode' in object.metadata.annotations) || (has(object.spec.resourceClaims) && size(object.spec.resourceClaims) > 0)
{{- end -}}

{{/* CEL: the pod makes a unified request; equal to
     migpilot.webhook.registering.UNIFIED_CONDITION (a test checks). */}}
{{- define "migpilot.unifiedCondition" -}}
object.spec.containers.exists(c, has(c.resources) && ((has(c.resources.requests) && c.resources.requests.exists(r, r in ['nvidia.com/gpumem', 'nvidia.com/gpumem-percentage', 'nvidia.com/gpucores'])) || (has(c.resources.limits) && c.resources.limits.exists(r, r in ['nvidia.com/gpumem', 'nvidia.com/gpumem-percentage', 'nvidia.com/gpucores'])))) || (has(object.spec.initContainers) && object.spec.initContainers.exists(c, has(c.resources) && ((has(c.resources.requests) && c.resources.requests.exists(r, r in ['nvidia.com/gpumem', 'nvidia.com/gpumem-percentage', 'nvidia.com/gpucores'])) || (has(c.resources.limits) && c.resources.limits.exists(r, r in ['nvidia.com/gpumem', 'nvidia.com/gpumem-percentage', 'nvidia.com/gpucores']))))) || (has(object.metadata.annotations) && 'nvidia.com/vgpu-mode' in object.metadata.annotations)
{{- end -}}

{{/* agent.migPartedConfigMap (NAMESPACE/NAME[:KEY]) as {namespace, name}, as the agent's
     statics.ConfigMapRef.parse reads it. */}}
{{- define "migpilot.migPartedConfigMap" -}}
{{- $ref := .Values.agent.migPartedConfigMap | splitList ":" | first }}
{{- $parts := splitList "/" $ref }}
namespace: {{ first $parts | quote }}
name: {{ last $parts | quote }}
{{- end -}}
